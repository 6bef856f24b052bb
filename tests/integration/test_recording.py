"""record_decision_whole: a cancelled caller still gets its decision recorded whole, and
the deadline bounds how long anyone waits for it (the one helper behind `outbox mcp` and
the pydantic-ai toolset)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.connections import TransactionDeadlineExceeded
from outbox.intent import prepare_decision
from outbox.recording import CUT_MARGIN_SECONDS, record_decision_whole
from outbox.sandbox.tools import build_registry
from outbox.store import NewDecision

from support.db_helpers import committed_counts, execute_admin
from support.waiting import eventually

REFUND = {"payment_id": "pay_whole_1", "amount_cents": 2500, "reason": "parcel arrived damaged"}
# Long enough for a busy machine to reach the lock; the lock is what ends the wait.
LONG_DEADLINE_SECONDS = 30.0
SHORT_DEADLINE_SECONDS = 1.0
# What a busy 2-core machine may add to a deadline before the caller hears of it.
SCHEDULING_SLACK_SECONDS = 3.0


def decision() -> NewDecision:
    return prepare_decision(
        build_registry(), "send_refund", REFUND, run_id="run_whole", decision_key="call_1"
    )


@contextmanager
def operations_locked(database_url: str) -> Iterator[psycopg.Connection]:
    """The operations table held, so that a recording waits mid-transaction."""
    with psycopg.connect(database_url) as blocker:
        blocker.execute("LOCK TABLE operations IN EXCLUSIVE MODE")
        yield blocker


async def recording_waits_for_the_lock(database_url: str, blocker: psycopg.Connection) -> None:
    def waiting() -> bool:
        rows = execute_admin(
            database_url,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND pid <> %s",
            (blocker.info.backend_pid,),
        )
        return bool(rows[0][0])

    await eventually(
        lambda: asyncio.to_thread(waiting), within=10, what="the recording to wait for the lock"
    )


@pytest.mark.parametrize("canceller", ["asyncio", "anyio"])
async def test_a_cancelled_caller_still_gets_its_decision_recorded_whole(
    database_url: str, async_engine: AsyncEngine, canceller: str
) -> None:
    scopes: list[anyio.CancelScope] = []

    async def caller() -> None:
        # asyncio's task.cancel() is delivered once; anyio's scope cancels again on every
        # turn of the loop until the task leaves it.
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await record_decision_whole(async_engine, decision(), seconds=LONG_DEADLINE_SECONDS)

    with operations_locked(database_url) as blocker:
        call = asyncio.create_task(caller())
        await recording_waits_for_the_lock(database_url, blocker)
        # Cancelled while the transaction cannot have committed.
        if canceller == "asyncio":
            call.cancel()
        else:
            scopes[0].cancel()
        await asyncio.sleep(0)  # the cancellation reaches the caller, not the recording
        assert not call.done()
        blocker.rollback()

    if canceller == "asyncio":
        with pytest.raises(asyncio.CancelledError):
            await call
    else:
        await call  # the scope absorbs its own cancellation
    counts = committed_counts(database_url)
    assert (counts.operations, counts.outbox) == (1, 1)


async def test_the_deadline_bounds_a_cancelled_callers_wait(
    database_url: str, async_engine: AsyncEngine
) -> None:
    with operations_locked(database_url) as blocker:
        call = asyncio.create_task(
            record_decision_whole(async_engine, decision(), seconds=SHORT_DEADLINE_SECONDS)
        )
        await recording_waits_for_the_lock(database_url, blocker)
        cancelled_at = time.monotonic()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        waited = time.monotonic() - cancelled_at
    assert waited < SHORT_DEADLINE_SECONDS + CUT_MARGIN_SECONDS + SCHEDULING_SLACK_SECONDS
    assert committed_counts(database_url).operations == 0


async def test_a_recording_past_its_deadline_is_cut_and_says_so(
    database_url: str, async_engine: AsyncEngine
) -> None:
    with operations_locked(database_url):
        started = time.monotonic()
        with pytest.raises(TransactionDeadlineExceeded):
            await record_decision_whole(async_engine, decision(), seconds=SHORT_DEADLINE_SECONDS)
        took = time.monotonic() - started
    assert SHORT_DEADLINE_SECONDS <= took < SHORT_DEADLINE_SECONDS + SCHEDULING_SLACK_SECONDS
    assert committed_counts(database_url).operations == 0
