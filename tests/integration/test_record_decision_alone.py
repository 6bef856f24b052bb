"""A decision recorded as a transaction of its own (``own_transaction=True``): one round
trip on an autocommit connection, committed when the call returns, refused on a
connection where it would wait for a commit."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import pq
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import (
    ConfigurationError,
    DecisionConflict,
    RecordedDecision,
    Registry,
    record_decision,
    record_decision_async,
)
from outbox.connections import sever
from outbox.errors import TransientDatabaseError
from outbox.store import AsyncConnection, SyncConnection

from support.db_helpers import Counts, committed_counts, execute_admin
from support.logs import logged
from support.waiting import eventually

REFUND = {"payment_id": "pay_1", "amount_cents": 1250, "reason": "damaged parcel"}
OWN: dict[str, Any] = {
    "tool_input": REFUND,
    "run_id": "r",
    "decision_key": "k",
    "own_transaction": True,
}


@contextmanager
def wire_trace(connection: psycopg.Connection | psycopg.AsyncConnection) -> Iterator[list[str]]:
    """The protocol messages ``connection`` sends and receives in the block, one per
    item, as libpq's trace writes them (filled in when the block ends)."""
    messages: list[str] = []
    with tempfile.TemporaryFile() as trace:
        connection.pgconn.trace(trace.fileno())
        connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield messages
        finally:
            connection.pgconn.untrace()
        trace.seek(0)
        messages.extend(trace.read().decode().splitlines())


def round_trips(messages: list[str]) -> list[str]:
    """The server's ReadyForQuery answers: one per round trip, with the transaction
    status it ended in (I idle, T in a transaction)."""
    return [line.split()[-1] for line in messages if "ReadyForQuery" in line]


def decide(connection: SyncConnection, registry: Registry, **overrides: Any) -> RecordedDecision:
    """The refund decision, a transaction of its own unless ``overrides`` say otherwise."""
    arguments = {**OWN, **overrides}
    tool_input = arguments.pop("tool_input")
    return record_decision(connection, registry, "send_refund", tool_input, **arguments)


async def decide_async(
    connection: AsyncConnection, registry: Registry, **overrides: Any
) -> RecordedDecision:
    arguments = {**OWN, **overrides}
    tool_input = arguments.pop("tool_input")
    return await record_decision_async(connection, registry, "send_refund", tool_input, **arguments)


def test_a_decision_of_its_own_commits_in_one_round_trip(
    database_url: str, registry: Registry
) -> None:
    with psycopg.connect(database_url, autocommit=True) as connection:
        # The first decision of a process also reads the deployment's fingerprint key.
        decide(connection, registry)
        with wire_trace(connection) as messages:
            recorded = decide(
                connection,
                registry,
                tool_input={**REFUND, "payment_id": "pay_2"},
                decision_key="k2",
            )

    assert round_trips(messages) == ["I"]
    assert not [line for line in messages if "BEGIN" in line or "COMMIT" in line]
    assert recorded.created
    assert committed_counts(database_url) == Counts(2, 2, 2)


def test_in_the_callers_transaction_the_same_decision_takes_three_round_trips(
    database_url: str, registry: Registry
) -> None:
    # The comparison the one round trip above is measured against.
    with psycopg.connect(database_url) as connection:
        record_decision(connection, registry, "send_refund", REFUND, run_id="r")
        connection.commit()
        with wire_trace(connection) as messages:
            record_decision(
                connection, registry, "send_refund", {**REFUND, "payment_id": "pay_2"}, run_id="r"
            )
            connection.commit()

    assert round_trips(messages) == ["T", "T", "I"]


async def test_the_async_twin_commits_before_it_returns_and_logs_the_line(
    database_url: str, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.lifecycle")
    connection = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        recorded = await decide_async(connection, registry)
        # Seen from another session while this one is still open: committed already.
        assert committed_counts(database_url) == Counts(1, 1, 1)
    finally:
        await connection.close()

    assert logged(caplog, "operation.prepared", id=recorded.operation.display_id)


def test_sqlalchemy_autocommit_writes_the_line_though_no_commit_ever_comes(
    database_url: str, engine: sa.Engine, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    # SQLAlchemy holds lifecycle lines for its commit event; under AUTOCOMMIT the caller
    # never commits, and closing the connection rolls back (a no-op) instead.
    caplog.set_level(logging.INFO, logger="outbox.lifecycle")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        recorded = decide(connection, registry)

    assert committed_counts(database_url) == Counts(1, 1, 1)
    assert logged(caplog, "operation.prepared", id=recorded.operation.display_id)


async def test_sqlalchemy_async_autocommit_records_a_decision_of_its_own(
    database_url: str,
    async_engine: AsyncEngine,
    registry: Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.lifecycle")
    async with async_engine.connect() as opened:
        connection = await opened.execution_options(isolation_level="AUTOCOMMIT")
        recorded = await decide_async(connection, registry)

    assert committed_counts(database_url) == Counts(1, 1, 1)
    assert logged(caplog, "operation.prepared", id=recorded.operation.display_id)


def test_a_connection_that_would_wait_for_a_commit_is_refused_and_nothing_is_written(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with psycopg.connect(database_url) as connection:
        with pytest.raises(ConfigurationError, match="autocommit mode outside"):
            decide(connection, registry)
        connection.commit()
    with (
        psycopg.connect(database_url, autocommit=True) as connection,
        connection.transaction(),
        pytest.raises(ConfigurationError, match="autocommit"),
    ):
        decide(connection, registry)
    with engine.begin() as in_a_block, pytest.raises(ConfigurationError, match="autocommit"):
        decide(in_a_block, registry)

    assert committed_counts(database_url) == Counts(0, 0, 0)


def test_without_the_flag_an_autocommit_connection_is_still_refused_with_both_fixes(
    database_url: str, registry: Registry
) -> None:
    with (
        psycopg.connect(database_url, autocommit=True) as connection,
        pytest.raises(ConfigurationError) as refused,
    ):
        record_decision(connection, registry, "send_refund", REFUND, run_id="r")

    assert "conn.transaction()" in str(refused.value)
    assert "own_transaction=True" in str(refused.value)
    assert committed_counts(database_url) == Counts(0, 0, 0)


def test_a_decision_key_replays_and_refuses_a_changed_intent_on_its_own_too(
    database_url: str, registry: Registry
) -> None:
    with psycopg.connect(database_url, autocommit=True) as connection:
        first = decide(connection, registry)
        again = decide(connection, registry, tool_input=dict(reversed(list(REFUND.items()))))
        with pytest.raises(DecisionConflict):
            decide(connection, registry, tool_input={**REFUND, "amount_cents": 99_00})

    assert (first.created, again.created) == (True, False)
    assert again.operation.id == first.operation.id
    assert committed_counts(database_url) == Counts(1, 1, 1)


def test_a_decision_of_its_own_needs_a_decision_key_and_writes_nothing_without(
    database_url: str, registry: Registry
) -> None:
    with (
        psycopg.connect(database_url, autocommit=True) as connection,
        pytest.raises(ConfigurationError, match="needs a decision_key"),
    ):
        decide(connection, registry, decision_key=None)

    assert committed_counts(database_url) == Counts(0, 0, 0)


async def test_a_call_cut_mid_statement_is_found_by_its_retry_and_never_recorded_twice(
    database_url: str, registry: Registry
) -> None:
    # Why the key is required: a statement the client gave up on runs on in its backend
    # and, in autocommit, commits when it ends.
    cut = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    with psycopg.connect(database_url) as blocker:
        blocker.execute("LOCK TABLE operations IN EXCLUSIVE MODE")
        call = asyncio.create_task(decide_async(cut, registry))
        orphan = cut.info.backend_pid
        await eventually(
            lambda: asyncio.to_thread(waits_for_a_lock, database_url, orphan),
            within=10,
            what="the recording to wait for the lock",
        )
        sever(cut)
        with pytest.raises(TransientDatabaseError):
            await call
        blocker.rollback()
    await eventually(
        lambda: asyncio.to_thread(backend_gone, database_url, orphan),
        within=10,
        what="the cut statement's backend to end",
    )
    await cut.close()
    recorded_by_the_cut_call = committed_counts(database_url).operations

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as again:
        retried = await decide_async(again, registry)

    assert retried.created == (recorded_by_the_cut_call == 0)
    assert committed_counts(database_url) == Counts(1, 1, 1)


def waits_for_a_lock(database_url: str, pid: int) -> bool:
    rows = execute_admin(
        database_url, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
    )
    return bool(rows) and rows[0][0] == "Lock"


def backend_gone(database_url: str, pid: int) -> bool:
    return not execute_admin(database_url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
