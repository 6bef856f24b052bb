"""What a production install ships: the wheel built from this checkout, file by file.

The chaos harness, its TCP proxy, its checker and the statements that end database
sessions stay in the repository (harness/): an installed ``outbox`` must not be able to
stop a broker. The payment sandbox and ``outbox demo`` ship on purpose (onboarding);
pyproject.toml says why.
"""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    # hatchling is in the test extra: build without isolation or network, as pip would.
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out)],
        cwd=REPOSITORY,
        check=True,
        capture_output=True,
        timeout=60,
    )
    (built,) = out.glob("*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def names(wheel: zipfile.ZipFile) -> list[str]:
    return wheel.namelist()


def test_the_chaos_harness_is_not_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    files = names(wheel)

    assert [name for name in files if name.startswith("harness/")] == []
    modules = [Path(name).name for name in files if name.endswith(".py")]
    assert [m for m in modules if "chaos" in m or "proxy" in m or m == "diagnostics.py"] == []


def test_the_sandbox_and_the_demo_ship_on_purpose(wheel: zipfile.ZipFile) -> None:
    files = set(names(wheel))

    for module in ("provider.py", "demo.py", "tools.py", "cli.py"):
        assert f"outbox/sandbox/{module}" in files
    # The rest of the runtime is there too, so the listing above is not of an empty wheel.
    assert {
        "outbox/cli/__init__.py",
        "dispatcher/cli.py",
        "consumer/cli.py",
        "outbox/schema.sql",
    } <= files


def test_no_outbox_command_runs_chaos(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = [n for n in names(wheel) if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())

    commands = dict(parser["outbox.commands"])
    assert "chaos" not in commands
    assert {"demo", "provider"} <= set(commands)
    everything = [target for section in parser.sections() for target in parser[section].values()]
    assert [target for target in everything if "chaos" in target or "harness" in target] == []


def test_the_console_ships_its_templates_and_stylesheet(wheel: zipfile.ZipFile) -> None:
    files = set(names(wheel))
    pages = ["overview", "operations", "operation", "escalations", "approvals", "dead_letters"]

    assert {f"outbox/console/templates/{page}.html" for page in pages} <= files
    assert "outbox/console/static/console.css" in files
