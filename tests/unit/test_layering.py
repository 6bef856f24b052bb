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
