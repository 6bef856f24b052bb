"""A decision's lifecycle lines are written when its transaction commits: a rolled-back
decision leaves no `operation.prepared` line (SQLAlchemy connections and sessions; a
plain psycopg connection has no commit event, and there lines are written at once)."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

from outbox import Registry, record_decision, record_decision_async

from support.logs import lifecycle_lines

REFUND = {"payment_id": "pay_1", "amount_cents": 100}


class Abandon(Exception):
    """The caller's own failure after recording, which rolls its transaction back."""


def prepared_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return lifecycle_lines(caplog, "operation.prepared")


@pytest.fixture(autouse=True)
def lifecycle_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outbox.lifecycle")


def test_a_committed_decision_writes_its_line_at_commit(
    engine: Any, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    with engine.begin() as connection:
        recorded = record_decision(connection, registry, "send_refund", REFUND, run_id="r")
        assert prepared_lines(caplog) == []  # not yet: the transaction is still open

    (line,) = prepared_lines(caplog)
    assert f"id={recorded.operation.display_id}" in line


def test_a_rolled_back_decision_leaves_no_line(
    engine: Any, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    def record_then_fail() -> None:
        with engine.begin() as connection:
            record_decision(connection, registry, "send_refund", REFUND, run_id="r")
            raise Abandon

    with pytest.raises(Abandon):
        record_then_fail()

    assert prepared_lines(caplog) == []
    # The next transaction on a pooled connection writes only its own line.
    with engine.begin() as connection:
        record_decision(connection, registry, "send_refund", REFUND, run_id="r2")
    assert len(prepared_lines(caplog)) == 1


def test_a_session_writes_the_line_when_it_commits(
    engine: Any, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    with Session(engine) as session:
        record_decision(session, registry, "send_refund", REFUND, run_id="r")
        assert prepared_lines(caplog) == []
        session.rollback()
        record_decision(session, registry, "send_refund", REFUND, run_id="r3")
        session.commit()

    assert len(prepared_lines(caplog)) == 1


async def test_an_async_connection_writes_the_line_at_commit(
    async_engine: AsyncEngine, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    async def record_then_fail() -> None:
        async with async_engine.begin() as connection:
            await record_decision_async(connection, registry, "send_refund", REFUND, run_id="a")
            raise Abandon

    with pytest.raises(Abandon):
        await record_then_fail()
    assert prepared_lines(caplog) == []

    async with async_engine.begin() as connection:
        await record_decision_async(connection, registry, "send_refund", REFUND, run_id="b")
        assert prepared_lines(caplog) == []

    assert len(prepared_lines(caplog)) == 1


def test_a_plain_psycopg_connection_writes_the_line_at_once(
    database_url: str, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(database_url) as connection:
        record_decision(connection, registry, "send_refund", REFUND, run_id="p")
        assert len(prepared_lines(caplog)) == 1
        connection.rollback()
