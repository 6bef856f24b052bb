from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox import schema as outbox_schema
from outbox.sandbox.scratch import ScratchDatabase

OUTBOX = str(Path(sys.executable).parent / "outbox")
REPOSITORY = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OUTBOX, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture
def missing_database_url(postgres_server_url: str) -> Iterator[str]:
    # Named, not created: `outbox migrate` is to create it.
    database = ScratchDatabase.unique(postgres_server_url, "outbox_accept")
    yield database.url
    database.drop()


def test_migrate_creates_a_missing_database_then_is_a_no_op(missing_database_url: str) -> None:
    first = run("migrate", "--database-url", missing_database_url)
    second = run("migrate", env={"OUTBOX_DATABASE_URL": missing_database_url})

    assert first.returncode == 0, first.stderr
    assert "did not exist: created it" in first.stdout
    assert f"schema version {outbox_schema.SCHEMA_VERSION} is applied" in first.stdout
    assert second.returncode == 0, second.stderr
    assert "created" not in second.stdout
    assert f"schema version {outbox_schema.SCHEMA_VERSION} is applied" in second.stdout
    with psycopg.connect(missing_database_url) as connection:
        assert outbox_schema.schema_version(connection) == outbox_schema.SCHEMA_VERSION


def test_migrate_against_an_unreachable_server_fails_clearly_without_the_password() -> None:
    result = run(
        "migrate", "--database-url", "postgresql://someone:s3cret-canary@127.0.0.1:1/outbox"
    )

    assert result.returncode == 2
    assert "cannot connect to postgresql://someone:***@127.0.0.1:1/outbox" in result.stderr
    assert "OUTBOX_DATABASE_URL" in result.stderr
    assert "s3cret-canary" not in result.stderr + result.stdout


def test_migrate_refuses_a_url_for_another_database_engine() -> None:
    result = run("migrate", env={"OUTBOX_DATABASE_URL": "mysql://root:s3cret-canary@localhost/x"})

    assert result.returncode == 2
    assert "OUTBOX_DATABASE_URL" in result.stderr
    assert "postgresql://" in result.stderr
    assert "s3cret-canary" not in result.stderr


def test_every_flag_names_its_environment_variable() -> None:
    result = run("migrate", "--help")
    top = run("--help")

    assert "OUTBOX_DATABASE_URL" in result.stdout
    assert "OUTBOX_LOG_LEVEL" in top.stdout
    assert "OUTBOX_LOG_FORMAT" in top.stdout


def test_the_readme_quickstart_runs_and_is_idempotent(database_url: str) -> None:
    example = [sys.executable, str(REPOSITORY / "examples" / "quickstart.py")]
    env = {**os.environ, "OUTBOX_DATABASE_URL": database_url}
    first = subprocess.run(
        example, capture_output=True, text=True, env=env, timeout=60, check=False
    )
    second = subprocess.run(
        example, capture_output=True, text=True, env=env, timeout=60, check=False
    )

    assert first.returncode == 0, first.stderr
    assert first.stdout.endswith(" prepared created=True\n")
    assert second.stdout == first.stdout.replace("created=True", "created=False")


def test_the_readme_shows_the_quickstart_as_it_is() -> None:
    readme = (REPOSITORY / "README.md").read_text(encoding="utf-8")
    example = (REPOSITORY / "examples" / "quickstart.py").read_text(encoding="utf-8")

    assert f"```python\n{example}```" in readme


@pytest.mark.timeout(180)
def test_the_wheel_carries_the_schema_the_roles_and_the_queries(tmp_path: Path) -> None:
    import zipfile

    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPOSITORY),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("effect_outbox-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    assert {
        "outbox/schema.sql",
        "outbox/roles.sql",
        "outbox/sql/queries.sql",
        "outbox/py.typed",
    } <= names
    assert {"dispatcher/__main__.py", "consumer/__main__.py"} <= names
    # `outbox migrate --roles` from an installed wheel reads the packaged copy.
    for name in ("schema.sql", "roles.sql"):
        packaged = zipfile.ZipFile(wheel).read(f"outbox/{name}").decode()
        assert packaged == (REPOSITORY / name).read_text(encoding="utf-8")
