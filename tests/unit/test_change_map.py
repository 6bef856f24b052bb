"""docs/where-to-change-what.md is the map a contributor opens first: it names every
module of the three packages, and every path it names exists (#27: it had drifted)."""

from __future__ import annotations

import re
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
MAP = REPOSITORY / "docs" / "where-to-change-what.md"
PACKAGES = ("outbox", "dispatcher", "consumer")
# Package markers and entry points say nothing a contributor changes.
UNMAPPED = {"__init__.py", "__main__.py"}
# A path in backticks: a top-level directory of the repository, then more of it.
NAMED_PATH = re.compile(
    r"`((?:outbox|dispatcher|consumer|harness|tests|deploy|bench|docs|"
    r"examples)/[A-Za-z0-9_./-]*|[A-Za-z0-9_-]+\.(?:sql|yaml|toml|md))`"
)


def named_paths(text: str) -> set[str]:
    return {match.rstrip("/") for match in NAMED_PATH.findall(text)}


def modules() -> set[str]:
    return {
        str(path.relative_to(REPOSITORY))
        for package in PACKAGES
        for path in (REPOSITORY / package).rglob("*.py")
        if path.name not in UNMAPPED
    }


def test_the_map_names_every_module() -> None:
    assert sorted(modules() - named_paths(MAP.read_text(encoding="utf-8"))) == []


def test_every_path_the_map_names_exists() -> None:
    missing = [
        path
        for path in named_paths(MAP.read_text(encoding="utf-8"))
        if not (REPOSITORY / path).exists()
    ]
    assert sorted(missing) == []


def test_the_path_scan_sees_modules_directories_and_top_level_files() -> None:
    text = "`outbox/store/` and `consumer/policy.py` (`schema.sql`), not `acks` or `a/b`"
    assert named_paths(text) == {"outbox/store", "consumer/policy.py", "schema.sql"}
