"""A database URL that names several hosts works wherever a URL is taken: the first host
here refuses connections (a primary that is gone), so every path must reach the second,
as it would a promoted standby."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import OperationState, Registry, Settings, record_decision, record_decision_async
from outbox.cli import run_command
from outbox.settings import sqlalchemy_url

from support.consume_helpers import in_state, running_consumer
from support.dispatch_helpers import running_dispatcher
from support.ports import closed_port
from support.waiting import eventually

REFUND = {"payment_id": "pay_1", "amount_cents": 1250}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def two_hosts(database_url: str) -> str:
    """The test's database behind a host list whose first member is gone."""
    parts = urlsplit(database_url)
    user = f"{parts.username}@" if parts.username else ""
    netloc = f"{user}127.0.0.1:{closed_port()},{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc, query="target_session_attrs=read-write"))


def test_the_library_records_through_psycopg_and_sqlalchemy(
    two_hosts: str, registry: Registry
) -> None:
    with psycopg.connect(two_hosts) as connection:
        plain = record_decision(connection, registry, "send_refund", REFUND, run_id="psycopg")
    engine = sa.create_engine(sqlalchemy_url(two_hosts))
    try:
        with engine.begin() as connection:
            through_sa = record_decision(
                connection, registry, "send_refund", REFUND, run_id="sqlalchemy"
            )
    finally:
        engine.dispose()

    assert plain.created
    assert through_sa.created


async def test_the_async_engine_records_too(two_hosts: str, registry: Registry) -> None:
    # What `outbox mcp` and the pydantic-ai example build from OUTBOX_DATABASE_URL.
    engine = create_async_engine(sqlalchemy_url(two_hosts))
    try:
        async with engine.begin() as connection:
            recorded = await record_decision_async(
                connection, registry, "send_refund", REFUND, run_id="async"
            )
    finally:
        await engine.dispose()

    assert recorded.created


def test_the_operator_commands_take_the_host_list(
    two_hosts: str,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with psycopg.connect(two_hosts) as connection:
        recorded = record_decision(connection, registry, "send_refund", REFUND, run_id="ops")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", two_hosts)

    assert run_command(["ops", "show", recorded.operation.display_id]) == 0
    assert recorded.operation.display_id in capsys.readouterr().out


async def test_the_daemons_take_the_host_list(
    two_hosts: str, settings: Settings, registry: Registry
) -> None:
    multi = settings.model_copy(update={"database_url": SecretStr(two_hosts)})
    with psycopg.connect(two_hosts) as connection:
        operation = record_decision(
            connection, registry, "send_refund", REFUND, run_id="daemons"
        ).operation

    async with running_dispatcher(multi), running_consumer(multi, registry):
        await eventually(
            in_state(two_hosts, operation.id, OperationState.COMMITTED),
            within=30,
            what="the refund committed through the host list",
        )


def test_the_quickstart_takes_the_host_list(two_hosts: str) -> None:
    # README's first example, run as a user would, with the URL of a primary and standby.
    ran = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")],
        env={**os.environ, "OUTBOX_DATABASE_URL": two_hosts},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "created=True" in ran.stdout
