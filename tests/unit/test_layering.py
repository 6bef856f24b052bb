"""outbox is the base layer; the two daemons import only from it (docs/design.md section 2).
None of the three imports the chaos harness, which the wheel leaves out."""

from __future__ import annotations

import ast
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
    "outbox.callbacks_cli",
    "outbox.callbacks_server",
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
