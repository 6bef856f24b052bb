"""Every `outbox` command as a person runs it, when what it is given is wrong: a
database password never reaches the terminal, a failure is one line with an exit code,
and a closed pipe is no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

OUTBOX = str(Path(sys.executable).parent / "outbox")
CANARY = f"canary{uuid.uuid4().hex[:10]}"
OP = f"op_{uuid.UUID(int=5)}"
# Nothing here may reach a broker: a command that got this far would fail fast instead.
NO_BROKER = "amqp://guest:guest@127.0.0.1:1/"

# Every `outbox` command that reads OUTBOX_DATABASE_URL. The chaos harness reads it too
# but is no `outbox` command (python -m harness.chaos, outside the wheel), and is not
# run here: a bug that let it start would restart the shared RabbitMQ.
DATABASE_COMMANDS = [
    ["migrate"],
    ["migrate", "--roles", "--broker"],
    ["dispatcher", "--once"],
    ["dispatcher"],
    ["consumer", "--tools", "outbox.sandbox.tools"],
    ["ops", "list"],
    ["ops", "show", OP],
    ["ops", "resolve", OP, "--rejected", "--evidence", "e", "--by", "me"],
    ["approvals", "pending"],
    ["approvals", "grant", OP, "--by", "me"],
    ["approvals", "deny", OP, "--by", "me"],
    ["stats"],
    ["providers"],
    ["demo"],
]
# The commands that need the database to exist and give up when it does not (migrate
# creates it, the daemons wait for it, the demo makes its own).
ONE_SHOT_DATABASE_COMMANDS = [
    ["dispatcher", "--once"],
    *(
        command
        for command in DATABASE_COMMANDS
        if command[0] in ("ops", "approvals", "stats", "providers")
    ),
]


def run(
    *argv: str, env: dict[str, str], stdout: int = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OUTBOX, *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        env={**os.environ, "OUTBOX_AMQP_URL": NO_BROKER, **env},
        check=False,
    )


def assert_one_line_without_the_canary(result: subprocess.CompletedProcess[str]) -> str:
    everything = (result.stdout or "") + result.stderr
    assert CANARY not in everything
    assert "Traceback" not in everything
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", DATABASE_COMMANDS, ids=" ".join)
@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://u:can ary {CANARY}@127.0.0.1:5432/x",  # libpq quotes the password
        f"postgresql://u:{CANARY}@[127.0.0.1:5432/x",  # libpq quotes the whole URL
        f"postgresql://u:pw#{CANARY}@127.0.0.1:5432/x",  # urlsplit sees no password
    ],
    ids=["space", "bracket", "hash"],
)
def test_a_database_url_no_one_can_read_is_refused_without_its_password(
    command: list[str], url: str
) -> None:
    result = run(*command, env={"OUTBOX_DATABASE_URL": url})

    line = assert_one_line_without_the_canary(result)
    assert result.returncode == 2
    assert line.startswith(f"outbox {command[0]}: configuration error:")
    assert "OUTBOX_DATABASE_URL" in line
    assert "percent-encode" in line


@pytest.mark.parametrize(
    "command", [["dlq", "list"], ["dlq", "requeue", "--all"], ["migrate", "--broker"]], ids=" ".join
)
def test_an_amqp_url_no_one_can_read_is_refused_without_its_password(command: list[str]) -> None:
    env = {
        "OUTBOX_AMQP_URL": f"amqp://u:pw#{CANARY}@127.0.0.1:1/",
        "OUTBOX_DATABASE_URL": "postgresql://u@127.0.0.1:1/x",  # nothing to migrate
    }

    result = run(*command, env=env)

    line = assert_one_line_without_the_canary(result)
    assert result.returncode == 2
    assert "OUTBOX_AMQP_URL" in line


@pytest.fixture
def missing_database_url(postgres_server_url: str) -> str:
    """A database that does not exist on the test server, with a password in the URL
    (the test server trusts local connections, so it is never checked)."""
    parts = urlsplit(postgres_server_url)
    netloc = f"{parts.username or 'postgres'}:{CANARY}@{parts.hostname}:{parts.port or 5432}"
    return urlunsplit(parts._replace(netloc=netloc, path=f"/outbox_missing_{uuid.uuid4().hex}"))


@pytest.mark.parametrize("command", ONE_SHOT_DATABASE_COMMANDS, ids=" ".join)
def test_a_database_that_does_not_exist_is_named_as_the_cause(
    command: list[str], missing_database_url: str
) -> None:
    env = {"OUTBOX_DATABASE_URL": missing_database_url, "OUTBOX_LOG_LEVEL": "ERROR"}

    result = run(*command, env=env)

    line = assert_one_line_without_the_canary(result)
    assert result.returncode == 1
    assert "the database does not exist" in line
    if command[0] != "dispatcher":  # it names the peer it gave up on, not the URL
        assert f":***@{urlsplit(missing_database_url).hostname}" in line


def test_a_ttl_too_long_for_any_clock_is_a_usage_error() -> None:
    result = run("approvals", "grant", OP, "--by", "me", "--ttl", "99999999999d", env={})

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("outbox approvals grant: error: argument --ttl:")
    assert "at most 3650d" in last


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    reader, writer = os.pipe()
    os.close(reader)  # like `| head` that has read its lines: every write now fails
    try:
        result = run("contracts", "--tools", "outbox.sandbox.tools", env={}, stdout=writer)
    finally:
        os.close(writer)

    assert result.stderr == ""
    assert result.returncode == 141
