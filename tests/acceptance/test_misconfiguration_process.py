"""Misconfigurations that used to look healthy, as an operator meets them: the command
refuses in one line on stderr, with a non-zero exit and the fix, never a traceback or a
daemon that runs and does nothing useful."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from outbox import Settings

from support.ports import closed_port, taken_port
from support.system import connection_environment

OUTBOX = str(Path(sys.executable).parent / "outbox")
REPOSITORY = Path(__file__).resolve().parents[2]
# A command that does not refuse runs into this instead of hanging the suite.
REFUSES_WITHIN = 30
CANARY = f"canary{uuid.uuid4().hex[:10]}"


def nowhere() -> dict[str, str]:
    """Environment in which neither service answers: a refusal must come first."""
    return Settings(
        database_url=f"postgresql://postgres@127.0.0.1:{closed_port()}/outbox",
        amqp_url=f"amqp://guest:guest@127.0.0.1:{closed_port()}/",
        metrics_host="127.0.0.1",
        metrics_port=0,
    ).to_environment()


def run(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OUTBOX, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=REFUSES_WITHIN,
        check=False,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def broker_environment(settings: Settings) -> dict[str, str]:
    return connection_environment(settings, log_level="ERROR")


# --- 1. no schema ----------------------------------------------------------------------


def test_a_consumer_on_a_database_without_the_schema_exits_naming_outbox_migrate(
    empty_database_url: str,
) -> None:
    env = {**nowhere(), "OUTBOX_DATABASE_URL": empty_database_url, "OUTBOX_LOG_LEVEL": "ERROR"}

    result = run("consumer", "--tools", "outbox.sandbox.tools", env=env)

    line = one_line(result)
    assert result.returncode == 1
    assert line.startswith("outbox consumer: error:")
    assert "`outbox migrate`" in line


# --- 2. the broker topology ------------------------------------------------------------


def test_a_dispatcher_without_the_topology_exits_naming_migrate_broker(
    settings: Settings,
) -> None:
    result = run("dispatcher", "--once", env=broker_environment(settings))

    line = one_line(result)
    assert result.returncode == 2
    assert "outbox migrate --broker" in line
    assert "OUTBOX_QUEUE" in line
    assert "--declare-topology" in line


def test_migrate_broker_then_the_dispatcher_publishes(settings: Settings) -> None:
    env = broker_environment(settings)

    migrated = run("migrate", "--broker", env=env)
    drained = run("dispatcher", "--once", env=env)

    assert migrated.returncode == 0, migrated.stderr
    assert (drained.returncode, drained.stdout) == (0, "published=0 failed=0\n"), drained.stderr


@pytest.mark.parametrize(
    "how", [["--declare-topology"], ["OUTBOX_DECLARE_TOPOLOGY=true"]], ids=["flag", "variable"]
)
def test_declare_topology_is_a_flag_or_a_variable(settings: Settings, how: list[str]) -> None:
    env = broker_environment(settings)
    flags = [item for item in how if item.startswith("--")]
    for item in how:
        if "=" in item:
            name, value = item.split("=", 1)
            env[name] = value

    result = run("dispatcher", "--once", *flags, env=env)

    assert (result.returncode, result.stdout) == (0, "published=0 failed=0\n"), result.stderr


# --- 3. --tools is repeatable ----------------------------------------------------------


def test_consumer_keeps_every_tools_flag() -> None:
    # Both are missing: the first one named is the first one imported, so a flag that
    # replaced its predecessor would name only the second.
    result = run("consumer", "--tools", "no_such.first", "--tools", "no_such.second", env=nowhere())

    line = one_line(result)
    assert result.returncode == 2
    assert "'no_such.first'" in line


def test_contracts_keeps_every_tools_flag() -> None:
    result = run(
        "contracts",
        "--tools",
        "outbox.sandbox.tools",
        "--tools",
        "bench.e2e_tools",
        "--json",
        env={"PYTHONPATH": str(REPOSITORY)},
    )

    assert result.returncode == 0, result.stderr
    names = {card["name"] for card in json.loads(result.stdout)}
    assert {"send_refund", "send_email", "noop"} <= names


# --- 4. a metrics port already taken ---------------------------------------------------


@pytest.mark.parametrize(
    "command", [["consumer", "--tools", "outbox.sandbox.tools"], ["dispatcher"]], ids=" ".join
)
def test_a_taken_metrics_port_is_one_line_naming_metrics_port_zero(command: list[str]) -> None:
    with taken_port() as port:
        result = run(*command, "--metrics-port", str(port), env=nowhere())

    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith(f"outbox {command[0]}: configuration error:")
    assert f"127.0.0.1:{port}" in line
    assert "--metrics-port 0" in line


# --- 5. the demo without one of its services -------------------------------------------


@pytest.mark.parametrize(
    ("missing", "named", "start"),
    [
        ("OUTBOX_AMQP_URL", "RabbitMQ", "docker compose up -d rabbitmq"),
        ("OUTBOX_DATABASE_URL", "Postgres", "docker compose up -d postgres"),
    ],
)
def test_the_demo_names_the_missing_service_and_how_to_start_it(
    postgres_server_url: str, amqp_server_url: str, missing: str, named: str, start: str
) -> None:
    # The other service is the real one, so the demo fails at the check under test.
    env = {
        "OUTBOX_DATABASE_URL": postgres_server_url,
        "OUTBOX_AMQP_URL": amqp_server_url,
        missing: nowhere()[missing],
    }
    started = time.monotonic()

    result = run("demo", env=env)

    assert time.monotonic() - started < 15
    line = one_line(result)
    assert result.returncode != 0
    assert result.stdout == ""  # not half a story
    assert named in line
    assert start in line
    assert missing in line


def test_the_demo_says_when_the_broker_refuses_its_credentials(
    postgres_server_url: str, amqp_server_url: str
) -> None:
    parts = urlsplit(amqp_server_url)
    wrong = urlunsplit(parts._replace(netloc=f"guest:wrong-{CANARY}@{parts.hostname}:{parts.port}"))

    result = run("demo", env={"OUTBOX_DATABASE_URL": postgres_server_url, "OUTBOX_AMQP_URL": wrong})

    line = one_line(result)
    assert result.returncode == 1
    assert "refused the user name or password" in line
    assert CANARY not in line


# --- 6. settings that cannot be meant ---------------------------------------------------


def test_a_mistyped_variable_stops_a_command_in_one_line_naming_the_setting() -> None:
    # This run's own variables (OUTBOX_TEST_*, and CI's) are in the environment too, and
    # must pass: only the typo is named.
    result = run("contracts", "--tools", "outbox.sandbox.tools", env={"OUTBOX_LEASE_MARGN": "5"})

    line = one_line(result)
    assert result.returncode == 2
    assert result.stdout == ""
    assert line == (
        "outbox contracts: configuration error: OUTBOX_LEASE_MARGN is not a setting; "
        "did you mean OUTBOX_LEASE_MARGIN?"
    )


@pytest.mark.parametrize(
    ("command", "env", "named"),
    [
        (
            ["dispatcher", "--once"],
            {"OUTBOX_LEASE_MARGIN": "0.5", "OUTBOX_DB_TRANSACTION_TIMEOUT": "5"},
            ("OUTBOX_LEASE_MARGIN (0.5 s)", "OUTBOX_DB_TRANSACTION_TIMEOUT (5 s)"),
        ),
        (
            ["consumer", "--tools", "outbox.sandbox.tools", "--reconcile-interval", "0.000001"],
            {},
            ("OUTBOX_RECONCILE_INTERVAL: 1e-06 s",),
        ),
        (
            ["consumer", "--tools", "outbox.sandbox.tools"],
            {"OUTBOX_RETENTION": "-PT5S"},
            ("OUTBOX_RETENTION",),
        ),
    ],
    ids=["lease-shorter-than-transaction", "microsecond-interval", "negative-retention"],
)
def test_an_impossible_setting_stops_a_daemon_before_it_connects(
    command: list[str], env: dict[str, str], named: tuple[str, ...]
) -> None:
    result = run(*command, env={**nowhere(), **env})

    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith(f"outbox {command[0]}: configuration error: invalid settings: ")
    for name in named:
        assert name in line
    assert "Value error" not in line
