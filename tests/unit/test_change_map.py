"""docs/where-to-change-what.md is the map a contributor opens first: it names every
module of the three packages, every path it names exists (#27: it had drifted), and
every function, class, table or query a row names is defined in a place that row names
(#47: completeness is not correctness)."""

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


# A name in backticks that reads as code: an underscore or a capital letter in it (a
# command word such as `serve` or `providers` is not a definition to look for).
NAMED_CODE = re.compile(r"`([A-Za-z_][A-Za-z0-9_]{2,})(?:\(\))?`")
DEFINITION = re.compile(
    r"^\s*(?:async\s+)?def (\w+)|^\s*class (\w+)|^(\w+)\s*(?::[^=\n]*)?=|^-- name: (\w+)"
    r"|FUNCTION (?:IF NOT EXISTS )?(\w+)\(|TABLE IF NOT EXISTS (\w+)|TRIGGER (\w+)\s",
    re.M,
)
QUERIES = REPOSITORY / "outbox" / "sql" / "queries.sql"


def definitions() -> dict[str, set[Path]]:
    """Where each name of the code is defined (outside tests)."""
    found: dict[str, set[Path]] = {}
    for path in REPOSITORY.rglob("*"):
        if path.suffix not in (".py", ".sql") or {".venv", "tests"} & set(path.parts):
            continue
        for match in DEFINITION.finditer(path.read_text(encoding="utf-8", errors="ignore")):
            name = next(group for group in match.groups() if group)
            found.setdefault(name, set()).add(path)
    return found


def misplaced(map_text: str, defined: dict[str, set[Path]]) -> list[str]:
    """Each ``name -> paths`` of a row that names code defined in none of its paths. A
    query is in place in a row that says "query" or "queries" (queries.sql)."""
    wrong = []
    for row in map_text.splitlines():
        paths = [REPOSITORY / path for path in named_paths(row)] if row.startswith("|") else []
        for name in NAMED_CODE.findall(row) if paths else []:
            where = defined.get(name)
            if not where or ("_" not in name and name == name.lower()):
                continue
            if QUERIES in where and re.search(r"\bquer(y|ies)\b", row):
                continue
            if not any(place == path or path in place.parents for place in where for path in paths):
                wrong.append(f"{name} -> {sorted(str(p.relative_to(REPOSITORY)) for p in where)}")
    return wrong


def test_every_name_a_row_gives_is_defined_where_the_row_points() -> None:
    assert misplaced(MAP.read_text(encoding="utf-8"), definitions()) == []


def test_a_row_pointing_at_the_wrong_module_is_caught() -> None:
    row = "| loading the tools | `outbox/settings.py` (`registry_from`) | `tests/unit/x.py` |"
    assert misplaced(row, definitions()) == ["registry_from -> ['outbox/loading.py']"]


def test_the_path_scan_sees_modules_directories_and_top_level_files() -> None:
    text = "`outbox/store/` and `consumer/policy.py` (`schema.sql`), not `acks` or `a/b`"
    assert named_paths(text) == {"outbox/store", "consumer/policy.py", "schema.sql"}
