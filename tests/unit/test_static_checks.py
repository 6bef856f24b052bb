"""The code base stays typed (mypy --strict) and ruff clean: CI fails otherwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
@pytest.mark.timeout(300)
def test_static_check_passes(command: list[str]) -> None:
    result = subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_two_test_modules_share_a_name() -> None:
    # The test directories are not packages: pytest imports each file by its base name,
    # so a second file of the same name fails the whole run's collection.
    seen: dict[str, list[str]] = {}
    for path in sorted((REPOSITORY / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPOSITORY)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
