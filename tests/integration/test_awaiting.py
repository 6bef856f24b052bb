"""An agent learns how its decision ended: ``await_outcome`` against the real Postgres.

Operations are moved with the store's own transitions (as the consumer and the operator
would), each in its own committed transaction, while the waiters watch.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import (
    ApprovalStatus,
    ConfigurationError,
    Operation,
    OperationNotFound,
    OperationState,
    OutcomeStatus,
    OutcomeWatcher,
    RecordedDecision,
    Registry,
    await_outcome,
    await_outcome_sync,
    close_shared_watchers,
    get_outcome,
    get_outcome_async,
    grant_approval,
    record_decision,
    record_decision_async,
)
from outbox import store as outbox_store
from outbox.errors import TransientDatabaseError
from outbox.store import Store

from support.db_helpers import execute_admin
from support.waiting import eventually

S = OperationState
LEASE = timedelta(minutes=5)


def record(
    url: str, registry: Registry, amount_cents: int = 100, key: str | None = None
) -> Operation:
    with psycopg.connect(url) as connection:
        recorded = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": f"pay_{uuid.uuid4().hex[:8]}", "amount_cents": amount_cents},
            run_id="run_1",
            decision_key=uuid.uuid4().hex,
        )
    return recorded.operation


def move(url: str, operation: Operation, *targets: OperationState, **details: Any) -> Operation:
    """Legal edges, one commit each; ``details`` go with the last edge."""
    for index, target in enumerate(targets):
        with psycopg.connect(url) as connection:
            runner = Store(connection)
            if target is S.IN_FLIGHT:
                claimed = runner.run(outbox_store.claim(operation.id, owner="w", lease=LEASE))
                assert claimed is not None
                operation = claimed
                continue
            extra = details if index == len(targets) - 1 else {}
            operation = runner.run(
                outbox_store.transition(
                    operation.id,
                    source=operation.state,
                    target=target,
                    lease_token=operation.lease_token,
                    **extra,
                )
            )
    return operation


def row_of(url: str, operation: Operation) -> list[tuple[Any, ...]]:
    return execute_admin(url, "SELECT * FROM operations WHERE id = %s", (operation.id,))


@pytest.fixture
async def watcher(database_url: str) -> Any:
    async with OutcomeWatcher(database_url, poll_interval=30) as started:
        yield started


# --- what each state reads as --------------------------------------------------------


async def test_a_committed_refund_answers_with_its_reference_and_result(
    database_url: str, registry: Registry, watcher: OutcomeWatcher
) -> None:
    operation = record(database_url, registry)
    waiting = asyncio.create_task(watcher.wait(operation, timeout=60))
    await eventually(lambda: _is_waiting(watcher), within=10, what="the waiter registered")

    move(
        database_url,
        operation,
        S.IN_FLIGHT,
        S.COMMITTED,
        provider_reference="re_123",
        result={"refund_id": "re_123"},
    )
    outcome = await waiting

    assert outcome.status is OutcomeStatus.COMMITTED
    assert (outcome.final, outcome.needs_person) == (True, False)
    assert (outcome.provider_reference, outcome.result) == ("re_123", {"refund_id": "re_123"})
    assert (outcome.state, outcome.attempts, outcome.reason) == (S.COMMITTED, 1, None)
    assert (outcome.operation_id, outcome.display_id) == (operation.id, operation.display_id)
    assert (outcome.run_id, outcome.decision_key) == ("run_1", operation.decision_key)
    assert (outcome.tool, outcome.tool_version) == ("send_refund", 1)
    # The poll is 30 s away: the settlement's notification woke the watcher.
    assert watcher.notifications >= 1


async def _is_waiting(watcher: OutcomeWatcher) -> bool:
    return watcher.waiting > 0


async def test_a_rejection_is_final_with_its_reason_code(
    database_url: str, registry: Registry, watcher: OutcomeWatcher
) -> None:
    operation = move(
        database_url,
        record(database_url, registry),
        S.IN_FLIGHT,
        S.REJECTED,
        error_class="http_422",
    )

    outcome = await watcher.wait(operation, timeout=10, until="final")

    assert (outcome.status, outcome.final, outcome.reason) == (
        OutcomeStatus.REJECTED,
        True,
        "http_422",
    )
    assert outcome.result is None


async def test_an_escalation_returns_by_default_and_needs_a_person(
    database_url: str, registry: Registry, watcher: OutcomeWatcher
) -> None:
    operation = move(
        database_url,
        record(database_url, registry),
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        S.ESCALATED,
        error_class="lookups_unavailable",
    )

    outcome = await watcher.wait(operation, timeout=10)

    assert outcome.status is OutcomeStatus.ESCALATED
    assert (outcome.final, outcome.needs_person) == (False, True)
    assert outcome.reason == "lookups_unavailable"


async def test_until_final_keeps_waiting_through_an_escalation_until_a_person_resolves_it(
    database_url: str, registry: Registry, watcher: OutcomeWatcher
) -> None:
    operation = move(
        database_url,
        record(database_url, registry),
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        S.ESCALATED,
    )
    waiting = asyncio.create_task(watcher.wait(operation, timeout=60, until="final"))
    await eventually(lambda: _is_waiting(watcher), within=10, what="the waiter registered")
    await eventually(lambda: _all_read(watcher, 1), within=10, what="the watcher read it once")
    assert not waiting.done()

    move(database_url, operation, S.COMMITTED, provider_reference="re_9")
    outcome = await waiting

    assert (outcome.status, outcome.provider_reference) == (OutcomeStatus.COMMITTED, "re_9")


async def test_an_approval_wait_reads_as_awaiting_approval_until_granted(
    database_url: str, registry: Registry, watcher: OutcomeWatcher
) -> None:
    operation = record(database_url, registry, amount_cents=60_000)

    before = await watcher.wait(operation, timeout=0)
    with psycopg.connect(database_url) as connection:
        grant_approval(connection, operation.id, approved_by="lead", ttl=timedelta(hours=1))
    after = await watcher.wait(operation, timeout=0)
    with psycopg.connect(database_url) as connection:
        grant_approval(
            connection,
            operation.id,
            approved_by="lead",
            ttl=timedelta(hours=1),
            intent_hash="0" * 64,
        )
    changed = await watcher.wait(operation, timeout=0)

    assert (before.status, before.approval, before.needs_person) == (
        OutcomeStatus.AWAITING_APPROVAL,
        ApprovalStatus.MISSING,
        True,
    )
    assert (after.status, after.approval, after.reason) == (
        OutcomeStatus.PENDING,
        ApprovalStatus.VALID,
        None,
    )
    assert (changed.status, changed.reason) == (
        OutcomeStatus.AWAITING_APPROVAL,
        "approval_intent_changed",
    )


async def test_one_read_from_any_connection_flavour(
    database_url: str, registry: Registry, engine: sa.Engine, async_engine: AsyncEngine
) -> None:
    operation = record(database_url, registry)

    with engine.connect() as connection:
        from_sqlalchemy = get_outcome(connection, operation.id)
    with psycopg.connect(database_url) as connection:
        from_psycopg = get_outcome(connection, operation.id)
    async with async_engine.connect() as connection:
        from_async = await get_outcome_async(connection, operation.id)

    assert from_sqlalchemy == from_psycopg == from_async
    assert from_psycopg.status is OutcomeStatus.PENDING
    with psycopg.connect(database_url) as connection, pytest.raises(OperationNotFound):
        get_outcome(connection, uuid.uuid4())


# --- waiting: timeouts, cancellation, lost notifications ------------------------------


async def test_a_timeout_returns_the_latest_state_and_changes_nothing(
    database_url: str, registry: Registry, watcher: OutcomeWatcher
) -> None:
    operation = move(database_url, record(database_url, registry), S.IN_FLIGHT)
    before = row_of(database_url, operation)

    outcome = await watcher.wait(operation, timeout=0.2, until="final")

    assert (outcome.status, outcome.state, outcome.final) == (
        OutcomeStatus.PENDING,
        S.IN_FLIGHT,
        False,
    )
    assert row_of(database_url, operation) == before
    assert watcher.waiting == 0


async def test_a_cancelled_wait_changes_nothing_and_the_watcher_serves_the_next(
    database_url: str, registry: Registry, watcher: OutcomeWatcher
) -> None:
    operation = record(database_url, registry)
    before = row_of(database_url, operation)
    waiting = asyncio.create_task(watcher.wait(operation, timeout=60))
    await eventually(lambda: _is_waiting(watcher), within=10, what="the waiter registered")

    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting

    assert watcher.waiting == 0
    assert row_of(database_url, operation) == before
    move(database_url, operation, S.IN_FLIGHT, S.COMMITTED, provider_reference="re_1")
    outcome = await watcher.wait(operation, timeout=10)
    assert outcome.status is OutcomeStatus.COMMITTED


async def test_a_change_that_notified_nobody_is_found_by_the_poll(
    database_url: str, registry: Registry
) -> None:
    operation = move(database_url, record(database_url, registry), S.IN_FLIGHT)
    async with OutcomeWatcher(database_url, poll_interval=0.2) as watcher:
        waiting = asyncio.create_task(watcher.wait(operation, timeout=60, until="final"))
        await eventually(lambda: _is_waiting(watcher), within=10, what="the waiter registered")
        notified = watcher.notifications
        # A commit with triggers off sends no notification: the same as one that was
        # sent while this watcher was between connections.
        with psycopg.connect(database_url) as admin:
            admin.execute("SET LOCAL session_replication_role = replica")
            admin.execute(
                "UPDATE operations SET state = 'committed', lease_owner = NULL, "
                "lease_expires_at = NULL, provider_reference = 're_quiet' WHERE id = %s",
                (operation.id,),
            )
        outcome = await waiting

    assert (outcome.status, outcome.provider_reference) == (OutcomeStatus.COMMITTED, "re_quiet")
    assert watcher.notifications == notified


async def test_without_listen_the_poll_alone_answers(database_url: str, registry: Registry) -> None:
    operation = record(database_url, registry)
    async with OutcomeWatcher(database_url, poll_interval=0.2, listen=False) as watcher:
        waiting = asyncio.create_task(watcher.wait(operation, timeout=60, until="final"))
        await eventually(lambda: _is_waiting(watcher), within=10, what="the waiter registered")
        move(database_url, operation, S.IN_FLIGHT, S.COMMITTED, provider_reference="re_2")
        outcome = await waiting

    assert outcome.status is OutcomeStatus.COMMITTED
    assert (watcher.listening, watcher.notifications) == (False, 0)


async def test_the_watcher_reconnects_when_its_session_is_killed(
    database_url: str, registry: Registry
) -> None:
    operation = record(database_url, registry)
    async with OutcomeWatcher(database_url, poll_interval=0.5) as watcher:
        waiting = asyncio.create_task(watcher.wait(operation, timeout=60, until="final"))
        await eventually(lambda: _is_waiting(watcher), within=10, what="the waiter registered")
        killed = execute_admin(
            database_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'outbox-outcome-watcher' AND datname = current_database()",
        )
        assert killed == [(True,)]
        move(database_url, operation, S.IN_FLIGHT, S.COMMITTED, provider_reference="re_3")
        outcome = await waiting

    assert outcome.status is OutcomeStatus.COMMITTED


# --- what callers may pass -------------------------------------------------------------


async def test_awaiting_on_the_recording_connection_is_refused(
    database_url: str, registry: Registry, async_engine: AsyncEngine, engine: sa.Engine
) -> None:
    async with async_engine.begin() as connection:
        recorded = await record_decision_async(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 100},
            run_id="run_1",
        )
        with pytest.raises(ConfigurationError, match="Commit first, then await with the engine"):
            await await_outcome(connection, recorded)  # type: ignore[arg-type]
    with engine.begin() as connection, pytest.raises(ConfigurationError, match="not a connection"):
        await_outcome_sync(connection, recorded)  # type: ignore[arg-type]
    with (
        psycopg.connect(database_url) as connection,
        pytest.raises(ConfigurationError, match="not a connection"),
    ):
        await_outcome_sync(connection, recorded)  # type: ignore[arg-type]


async def test_an_uncommitted_decision_is_not_found_with_the_fix_in_the_message(
    database_url: str, registry: Registry, async_engine: AsyncEngine, watcher: OutcomeWatcher
) -> None:
    async with async_engine.connect() as connection:
        transaction = await connection.begin()
        recorded: RecordedDecision = await record_decision_async(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 100},
            run_id="run_1",
        )
        with pytest.raises(OperationNotFound, match="after your transaction commits"):
            await watcher.wait(recorded, timeout=5)
        await transaction.rollback()
    with pytest.raises(ValueError, match="until must be"):
        await watcher.wait(recorded, until="soon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        await watcher.wait(recorded, timeout=-1)
    with pytest.raises(TypeError, match="operation must be"):
        await watcher.wait("op_1")  # type: ignore[arg-type]


async def test_a_watcher_that_cannot_connect_says_so(closed_database_url: str) -> None:
    watcher = OutcomeWatcher(closed_database_url)
    with pytest.raises(TransientDatabaseError, match="could not connect"):
        await watcher.start()


@pytest.fixture
def closed_database_url() -> str:
    from support.ports import closed_port

    return f"postgresql://postgres@127.0.0.1:{closed_port()}/nothing"


async def test_await_outcome_on_an_engine_shares_one_watcher_per_loop(
    database_url: str, registry: Registry, async_engine: AsyncEngine
) -> None:
    operations = [record(database_url, registry) for _ in range(3)]
    try:
        outcomes = await asyncio.gather(
            *(await_outcome(async_engine, operation, timeout=0) for operation in operations)
        )
        watchers = execute_admin(
            database_url,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
            "'outbox-outcome-watcher' AND datname = current_database()",
        )
    finally:
        await close_shared_watchers()

    assert [outcome.status for outcome in outcomes] == [OutcomeStatus.PENDING] * 3
    assert watchers == [(1,)]


def test_the_blocking_twin_waits_for_a_settlement_made_elsewhere(
    database_url: str, registry: Registry, engine: sa.Engine
) -> None:
    operation = move(database_url, record(database_url, registry), S.IN_FLIGHT)
    settle = threading.Timer(
        0.3,
        move,
        args=(database_url, operation, S.COMMITTED),
        kwargs={"provider_reference": "re_4"},
    )
    settle.start()
    try:
        outcome = await_outcome_sync(engine, operation, timeout=60, until="final")
    finally:
        settle.join()
    timed_out = await_outcome_sync(
        database_url, record(database_url, registry), timeout=0.1, until="final"
    )

    assert (outcome.status, outcome.provider_reference) == (OutcomeStatus.COMMITTED, "re_4")
    assert timed_out.status is OutcomeStatus.PENDING


# --- scale ----------------------------------------------------------------------------


async def test_one_watcher_answers_a_thousand_waiters_with_a_few_batched_reads(
    database_url: str, registry: Registry
) -> None:
    operations = _recorded_in_one_transaction(database_url, registry, 1000)
    async with OutcomeWatcher(database_url, poll_interval=60) as watcher:
        waiting = [
            asyncio.create_task(watcher.wait(operation, timeout=120, until="final"))
            for operation in operations
        ]
        await eventually(lambda: _all_read(watcher, 1000), within=30, what="every waiter read once")
        reads_before = watcher.reads
        _settle_in_one_transaction(database_url, operations)
        outcomes = await asyncio.gather(*waiting)
        reads_after = watcher.reads

    assert [outcome.status for outcome in outcomes] == [OutcomeStatus.COMMITTED] * 1000
    # One settlement commit, one notification, one read for all of them; a few more
    # reads may come from waiters arriving in more than one batch, never one per waiter.
    assert reads_after - reads_before <= 3
    assert reads_after <= 20


async def _all_read(watcher: OutcomeWatcher, count: int) -> bool:
    return watcher.waiting == count and watcher.reads > 0 and watcher.pending_first_reads == 0


def _recorded_in_one_transaction(url: str, registry: Registry, count: int) -> list[Operation]:
    with psycopg.connect(url) as connection:
        return [
            record_decision(
                connection,
                registry,
                "send_refund",
                {"payment_id": f"pay_{index}", "amount_cents": 100},
                run_id="run_1",
                decision_key=f"k{index}",
            ).operation
            for index in range(count)
        ]


def _settle_in_one_transaction(url: str, operations: list[Operation]) -> None:
    with psycopg.connect(url) as connection:
        runner = Store(connection)
        claimed = runner.run(
            outbox_store.claim_many([(operation.id, LEASE) for operation in operations], owner="w")
        )
        runner.run(
            outbox_store.commit_many(
                [
                    outbox_store.ConfirmedEffect(
                        operation=operation,
                        provider_reference=f"re_{index}",
                        result={},
                        attributes={},
                    )
                    for index, operation in enumerate(claimed.values())
                ]
            )
        )


def test_each_event_loop_gets_a_watcher_of_its_own(database_url: str, registry: Registry) -> None:
    operation = record(database_url, registry)

    # asyncio.run ends its loop (and the shared watcher's task) each time: the second
    # call must not find the first loop's dead watcher.
    first = asyncio.run(await_outcome(database_url, operation, timeout=0))
    second = asyncio.run(await_outcome(database_url, operation, timeout=0))

    assert first.status is second.status is OutcomeStatus.PENDING


async def test_closing_the_watcher_answers_its_waiters_with_their_latest_outcome(
    database_url: str, registry: Registry
) -> None:
    operation = record(database_url, registry)
    watcher = OutcomeWatcher(database_url, poll_interval=30)
    await watcher.start()
    waiting = asyncio.create_task(watcher.wait(operation, timeout=None, until="final"))
    await eventually(lambda: _all_read(watcher, 1), within=10, what="the watcher read it once")

    await watcher.close()
    outcome = await asyncio.wait_for(waiting, 10)

    assert outcome.status is OutcomeStatus.PENDING
    with pytest.raises(ConfigurationError, match="was closed"):
        await watcher.wait(operation, timeout=0)


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ((S.IN_FLIGHT, S.COMMITTED), OutcomeStatus.COMMITTED),
        ((S.IN_FLIGHT, S.REJECTED), OutcomeStatus.REJECTED),
        ((S.IN_FLIGHT, S.OUTCOME_UNKNOWN, S.COMMITTED), OutcomeStatus.COMMITTED),
        ((S.IN_FLIGHT, S.OUTCOME_UNKNOWN, S.ESCALATED), OutcomeStatus.ESCALATED),
        ((S.REJECTED,), OutcomeStatus.REJECTED),
        ((S.ESCALATED,), OutcomeStatus.ESCALATED),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, tuple) else str(value),
)
async def test_every_ending_wakes_its_waiter_by_notification_not_by_the_poll(
    database_url: str,
    registry: Registry,
    watcher: OutcomeWatcher,
    path: tuple[OperationState, ...],
    status: OutcomeStatus,
) -> None:
    operation = record(database_url, registry)
    # The watcher polls every 30 s: an ending that notified nobody would time out here.
    waiting = asyncio.create_task(watcher.wait(operation, timeout=10))
    await eventually(lambda: _all_read(watcher, 1), within=10, what="the watcher read it once")
    notified = watcher.notifications

    move(database_url, operation, *path)
    outcome = await waiting

    assert outcome.status is status
    assert watcher.notifications > notified
