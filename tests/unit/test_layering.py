"""outbox is the base layer; the two daemons import only from it (docs/design.md section 2).
None of the three imports the chaos harness, which the wheel leaves out."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    # harness/ (chaos, the TCP proxy) is not in the wheel: an installed package that
    # imported it would fail, and would pull a broker-stopping command into production.
    "outbox": {"dispatcher", "consumer", "harness"},
    "dispatcher": {"consumer", "harness"},
    "consumer": {"dispatcher", "harness"},
}


def imported_top_level_packages(source: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def violations(package: str) -> list[str]:
    return [
        f"{path.relative_to(REPOSITORY)} imports {name}"
        for path in sorted((REPOSITORY / package).rglob("*.py"))
        for name in sorted(imported_top_level_packages(path.read_text(encoding="utf-8")))
        if name in FORBIDDEN[package]
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_the_layers(package: str) -> None:
    assert (REPOSITORY / package / "__init__.py").is_file()
    assert violations(package) == []


def test_the_import_scan_sees_every_import_form() -> None:
    source = (
        "import consumer\nimport dispatcher.loop as loop\nfrom consumer.worker import run\n"
        "from . import sibling\n"
        "def lazy():\n    from dispatcher import main\n"
    )
    assert imported_top_level_packages(source) == {"consumer", "dispatcher"}


# Inside the packages: the model and the plumbing (contracts, states, the store,
# connections, settings, metrics, the daemons' loops) are what every front end builds
# on, so none of them may import a front end: a command, a server, an integration or
# the sandbox. pgqueuer's import-linter contracts draw the same line.
FRONT_ENDS = (
    "outbox.__main__",
    "outbox.callbacks.cli",
    "outbox.callbacks.server",
    "outbox.cli",
    "outbox.console",
    "outbox.integrations",
    "outbox.mcp",
    "outbox.migrate",
    "outbox.operator",
    "outbox.sandbox",
    "outbox.serving",
    "dispatcher.__main__",
    "dispatcher.cli",
    "consumer.__main__",
    "consumer.cli",
    "consumer.processes",
)


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def imported_modules(source: str) -> set[str]:
    """Every module an absolute import names, and for ``from a import b`` also ``a.b``
    (``b`` may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def core_violations() -> list[str]:
    found = []
    for package in ("outbox", "dispatcher", "consumer"):
        for path in sorted((REPOSITORY / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPOSITORY).with_suffix("").parts)
            if within(module.removesuffix(".__init__"), FRONT_ENDS):
                continue
            imports = imported_modules(path.read_text(encoding="utf-8"))
            found += [
                f"{module} imports {name}" for name in sorted(imports) if within(name, FRONT_ENDS)
            ]
    return found


def test_the_model_and_the_plumbing_import_no_front_end() -> None:
    assert core_violations() == []


def test_the_front_end_scan_sees_a_module_imported_from_its_package() -> None:
    source = (
        "from outbox import cli\nfrom outbox.console.pages import render\nimport outbox.states\n"
    )
    names = {name for name in imported_modules(source) if within(name, FRONT_ENDS)}
    assert names == {"outbox.cli", "outbox.console.pages", "outbox.console.pages.render"}
    # A front end's prefix is not a prefix of every name it starts with.
    assert not within("outbox.mcp_tools_extra", ("outbox.mcp_tools",))
    assert not within("outbox.clients", ("outbox.cli",))


# The `outbox` command (outbox.cli) builds its parser from the operator's commands, so
# those import only the leaves beside it, the flags and how a command runs: were an
# operator module to import the package, which one loaded first would decide whether
# the import worked (#47).
CLI_LEAVES = ("outbox/cli/arguments.py", "outbox/cli/run.py")
LEAF_MODULES = ("outbox.cli.arguments", "outbox.cli.run")


def imports_of(relative: str) -> set[str]:
    return imported_modules((REPOSITORY / relative).read_text(encoding="utf-8"))


def test_no_operator_command_imports_the_outbox_command() -> None:
    operator = sorted((REPOSITORY / "outbox" / "operator").rglob("*.py"))
    assert len(operator) > 1
    modules = [str(path.relative_to(REPOSITORY)) for path in operator]
    found = [
        f"{module} imports {name}"
        for module in [*modules, "outbox/callbacks/cli.py"]
        for name in sorted(imports_of(module))
        if name == "outbox.cli"
    ]
    assert found == []


def test_the_command_toolkit_imports_no_command_group() -> None:
    found = [
        f"{leaf} imports {name}"
        for leaf in CLI_LEAVES
        for name in sorted(imports_of(leaf))
        if within(name, ("outbox.cli", "outbox.operator", "outbox.callbacks.cli"))
        and not within(name, LEAF_MODULES)
    ]
    assert found == []


def printed(source: str) -> str:
    """What ``source`` prints in a fresh interpreter, where nothing is imported yet."""
    done = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, cwd=REPOSITORY, check=False
    )
    assert (done.returncode, done.stderr) == (0, "")
    return done.stdout


def test_the_command_toolkit_loads_without_the_operator_commands() -> None:
    source = (
        "import sys\n"
        "import outbox.cli.arguments, outbox.cli.run\n"
        "print(sorted(m for m in sys.modules if m.startswith('outbox.operator')))\n"
    )
    assert printed(source) == "[]\n"


@pytest.mark.parametrize(
    "first",
    [
        "outbox.operator.commands",
        "outbox.operator.dlq_commands",
        "outbox.operator.callbacks_commands",
        "outbox.callbacks.cli",
        "outbox.cli",
    ],
)
def test_the_outbox_command_builds_whichever_module_loads_first(first: str) -> None:
    source = (
        f"import {first}\n"
        "from outbox.cli import build_parser\n"
        "actions = build_parser()._subparsers._group_actions[0].choices\n"
        "print(' '.join(name for name in ('ops', 'dlq', 'callbacks') if name in actions))\n"
    )
    assert printed(source) == "ops dlq callbacks\n"
