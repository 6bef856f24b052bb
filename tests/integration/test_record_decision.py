from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import (
    ConfigurationError,
    DecisionConflict,
    InputRejected,
    OperationState,
    Registry,
    SchemaMissing,
    intent_fingerprint,
    record_decision,
    record_decision_async,
)
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.fingerprint_key import keyed_fingerprint
from outbox.store import Store

from support.db_helpers import (
    ASYNC_FLAVORS,
    SYNC_FLAVORS,
    AsyncFlavor,
    Counts,
    SyncFlavor,
    async_transaction,
    committed_counts,
    execute_admin,
    sync_transaction,
)
from support.logs import logged

REFUND = {"payment_id": "pay_1", "amount_cents": 1250, "reason": "damaged parcel"}
BUSINESS = "refund_requests"
INSERT_BUSINESS = f"INSERT INTO {BUSINESS} (name) VALUES (:name)"


@pytest.fixture
def business_table(database_url: str) -> str:
    execute_admin(database_url, f"CREATE TABLE {BUSINESS} (name text NOT NULL)")
    return BUSINESS


@pytest.mark.parametrize("flavor", SYNC_FLAVORS)
def test_commit_makes_operation_outbox_row_and_event_visible_together(
    flavor: SyncFlavor,
    database_url: str,
    engine: sa.Engine,
    registry: Registry,
    business_table: str,
) -> None:
    with sync_transaction(flavor, database_url, engine) as tx:
        tx.execute(INSERT_BUSINESS, {"name": "ticket 42"})
        recorded = record_decision(
            tx.connection, registry, "send_refund", REFUND, run_id="run_12", decision_key="call_a"
        )
        assert committed_counts(database_url, business_table=business_table) == Counts(0, 0, 0, 0)
        tx.commit()

    assert recorded.created
    assert committed_counts(database_url, business_table=business_table) == Counts(1, 1, 1, 1)
    with psycopg.connect(database_url) as check:
        operation = Store(check).run(outbox_store.get_operation(recorded.operation.id))
        events = Store(check).run(outbox_store.events(recorded.operation.id))
        rows = Store(check).run(outbox_store.outbox_rows(recorded.operation.id))
    assert operation.state is OperationState.PREPARED
    assert operation.input == {**REFUND, "currency": "EUR"}
    assert operation.input_fingerprint == intent_fingerprint("send_refund", 1, operation.input)
    assert [event.name for event in events] == ["operation.prepared"]
    # The database function writes the event from its own arguments: the caller picks
    # none of its attributes.
    assert events[0].attributes == {"tool": "send_refund", "tool_version": 1, "run_id": "run_12"}
    assert [(row.routing_key, row.published_at) for row in rows] == [("send_refund.v1", None)]


@pytest.mark.parametrize("flavor", SYNC_FLAVORS)
def test_rollback_leaves_no_operation_no_outbox_row_no_event(
    flavor: SyncFlavor,
    database_url: str,
    engine: sa.Engine,
    registry: Registry,
    business_table: str,
) -> None:
    with sync_transaction(flavor, database_url, engine) as tx:
        tx.execute(INSERT_BUSINESS, {"name": "ticket 42"})
        record_decision(tx.connection, registry, "send_refund", REFUND, run_id="run_12")
        tx.rollback()

    assert committed_counts(database_url, business_table=business_table) == Counts(0, 0, 0, 0)


@pytest.mark.parametrize("flavor", ASYNC_FLAVORS)
async def test_async_commit_and_rollback(
    flavor: AsyncFlavor,
    database_url: str,
    async_engine: AsyncEngine,
    registry: Registry,
    business_table: str,
) -> None:
    async with async_transaction(flavor, database_url, async_engine) as tx:
        await tx.execute(INSERT_BUSINESS, {"name": "kept"})
        kept = await record_decision_async(
            tx.connection, registry, "send_refund", REFUND, run_id="run_1", decision_key="k"
        )
        assert committed_counts(database_url, business_table=business_table) == Counts(0, 0, 0, 0)
        await tx.commit()
    async with async_transaction(flavor, database_url, async_engine) as tx:
        await tx.execute(INSERT_BUSINESS, {"name": "dropped"})
        await record_decision_async(tx.connection, registry, "send_refund", REFUND, run_id="run_2")
        await tx.rollback()

    assert kept.created
    assert committed_counts(database_url, business_table=business_table) == Counts(1, 1, 1, 1)


@pytest.mark.parametrize("flavor", SYNC_FLAVORS)
def test_same_decision_key_twice_returns_the_first_operation(
    flavor: SyncFlavor, database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with sync_transaction(flavor, database_url, engine) as tx:
        first = record_decision(
            tx.connection, registry, "send_refund", REFUND, run_id="run_12", decision_key="call_a"
        )
        tx.commit()
    reordered = {key: REFUND[key] for key in reversed(list(REFUND))}
    with sync_transaction(flavor, database_url, engine) as tx:
        again = record_decision(
            tx.connection,
            registry,
            "send_refund",
            reordered,
            run_id="run_12",
            decision_key="call_a",
        )
        tx.commit()

    assert (first.created, again.created) == (True, False)
    assert again.operation.id == first.operation.id
    assert committed_counts(database_url) == Counts(1, 1, 1)


@pytest.mark.parametrize("flavor", SYNC_FLAVORS)
def test_changed_intent_under_the_same_key_is_a_conflict_and_writes_nothing(
    flavor: SyncFlavor, database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with sync_transaction(flavor, database_url, engine) as tx:
        first = record_decision(
            tx.connection, registry, "send_refund", REFUND, run_id="run_12", decision_key="call_a"
        )
        tx.commit()
    changed = {**REFUND, "amount_cents": 99_00}
    with sync_transaction(flavor, database_url, engine) as tx:
        with pytest.raises(DecisionConflict) as raised:
            record_decision(
                tx.connection,
                registry,
                "send_refund",
                changed,
                run_id="run_12",
                decision_key="call_a",
            )
        # The conflict is detected without a failed statement: the caller's
        # transaction stays usable and commits its other work.
        other = record_decision(
            tx.connection, registry, "send_refund", changed, run_id="run_12", decision_key="call_b"
        )
        tx.commit()

    assert first.operation.display_id in str(raised.value)
    assert "new decision key" in str(raised.value)
    assert raised.value.context["operation_id"] == first.operation.id
    assert other.created
    assert committed_counts(database_url) == Counts(2, 2, 2)


def test_another_tool_under_the_same_key_is_a_conflict(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with engine.begin() as connection:
        record_decision(
            connection, registry, "open_ticket", {"title": "t"}, run_id="r", decision_key="k"
        )
    with engine.begin() as connection, pytest.raises(DecisionConflict):
        record_decision(connection, registry, "send_refund", REFUND, run_id="r", decision_key="k")

    assert committed_counts(database_url) == Counts(1, 1, 1)


def test_decision_keys_are_scoped_per_run_and_optional(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with engine.begin() as connection:
        a = record_decision(
            connection, registry, "send_refund", REFUND, run_id="r1", decision_key="k"
        )
        b = record_decision(
            connection, registry, "send_refund", REFUND, run_id="r2", decision_key="k"
        )
        c = record_decision(connection, registry, "send_refund", REFUND, run_id="r1")
        d = record_decision(connection, registry, "send_refund", REFUND, run_id="r1")

    assert len({a.operation.id, b.operation.id, c.operation.id, d.operation.id}) == 4
    assert committed_counts(database_url) == Counts(4, 4, 4)


def test_concurrent_recorders_of_one_decision_key_create_one_operation(
    database_url: str, registry: Registry
) -> None:
    writers = 8
    barrier = threading.Barrier(writers)
    results: list[Any] = []
    failures: list[BaseException] = []

    def write() -> None:
        try:
            with psycopg.connect(database_url) as connection:
                barrier.wait(timeout=10)
                recorded = record_decision(
                    connection, registry, "send_refund", REFUND, run_id="run", decision_key="same"
                )
                connection.commit()
                results.append(recorded)
        except BaseException as failure:  # collected and re-raised by the test thread
            failures.append(failure)

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert failures == []
    assert sorted(r.created for r in results) == [False] * (writers - 1) + [True]
    assert len({r.operation.id for r in results}) == 1
    assert committed_counts(database_url) == Counts(1, 1, 1)


def test_invalid_input_writes_nothing_and_says_which_field(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with engine.begin() as connection, pytest.raises(InputRejected) as raised:
        record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": -5, "reason": "canary-7f3a"},
            run_id="r",
        )

    assert "amount_cents" in str(raised.value)
    assert "canary-7f3a" not in str(raised.value)
    assert committed_counts(database_url) == Counts(0, 0, 0)


def test_traceparent_travels_in_the_outbox_row_headers(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with engine.begin() as connection:
        recorded = record_decision(
            connection, registry, "send_refund", REFUND, run_id="r", traceparent=traceparent
        )
    with psycopg.connect(database_url) as check:
        rows = Store(check).run(outbox_store.outbox_rows(recorded.operation.id))

    assert [row.headers for row in rows] == [{"traceparent": traceparent}]


def test_approval_requirement_is_decided_at_record_time(
    engine: sa.Engine, registry: Registry
) -> None:
    with engine.begin() as connection:
        small = record_decision(connection, registry, "send_refund", REFUND, run_id="r")
        large = record_decision(
            connection, registry, "send_refund", {**REFUND, "amount_cents": 50_001}, run_id="r"
        )

    assert (small.operation.requires_approval, large.operation.requires_approval) == (False, True)


def test_the_operation_returned_is_the_row_stored(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    # The insert returns only a new row's id and time; the rest is built from the
    # decision and what the birth guard makes every new row. Read back, it is the same.
    with engine.begin() as connection:
        keyed = record_decision(
            connection, registry, "send_refund", REFUND, run_id="r", decision_key="k1"
        )
        keyless_to_approve = record_decision(
            connection, registry, "send_refund", {**REFUND, "amount_cents": 50_001}, run_id="r"
        )
    with psycopg.connect(database_url) as check:
        stored = [
            Store(check).run(outbox_store.get_operation(recorded.operation.id))
            for recorded in (keyed, keyless_to_approve)
        ]

    assert [keyed.operation, keyless_to_approve.operation] == stored
    assert (stored[1].decision_key, stored[1].requires_approval) == (None, True)


def test_autocommit_connection_is_refused_because_writes_would_not_commit_together(
    database_url: str, registry: Registry
) -> None:
    with psycopg.connect(database_url, autocommit=True) as connection:
        with pytest.raises(ConfigurationError, match="autocommit"):
            record_decision(connection, registry, "send_refund", REFUND, run_id="r")
        # Inside an explicit transaction block the same connection is fine.
        with connection.transaction():
            recorded = record_decision(connection, registry, "send_refund", REFUND, run_id="r")

    assert recorded.created
    assert committed_counts(database_url) == Counts(1, 1, 1)


def test_a_driver_other_than_psycopg_is_refused_with_the_fix(registry: Registry) -> None:
    sqlite = sa.create_engine("sqlite://")
    with sqlite.connect() as connection, pytest.raises(ConfigurationError) as raised:
        record_decision(connection, registry, "send_refund", REFUND, run_id="r")
    sqlite.dispose()

    assert "postgresql+psycopg://" in str(raised.value)


def test_database_without_the_schema_says_to_run_migrate(
    empty_database_url: str, registry: Registry
) -> None:
    with psycopg.connect(empty_database_url) as connection:
        with pytest.raises(SchemaMissing, match="outbox migrate"):
            record_decision(connection, registry, "send_refund", REFUND, run_id="r")
        connection.rollback()


def test_the_short_fingerprint_is_keyed_by_the_deployments_key(
    engine: Any, registry: Registry, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.lifecycle")
    with engine.begin() as connection:
        operation = record_decision(
            connection, registry, "send_refund", REFUND, run_id="run_key"
        ).operation
    key = execute_admin(database_url, "SELECT fingerprint_key FROM outbox_deployment")[0][0]

    # Keyed with the deployment's key: a log reader cannot recompute it from a guess.
    expected = keyed_fingerprint(key, operation.input_fingerprint)
    assert expected != operation.input_fingerprint[:12]
    assert logged(caplog, "operation.prepared", fingerprint=expected)


def test_the_short_fingerprint_uses_the_key_from_the_environment_when_set(
    engine: Any,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.lifecycle")
    monkeypatch.setenv("OUTBOX_FINGERPRINT_KEY", "a-key-the-whole-deployment-shares-0123456789")
    with engine.begin() as connection:
        operation = record_decision(
            connection, registry, "send_refund", REFUND, run_id="run_env"
        ).operation

    assert logged(
        caplog,
        "operation.prepared",
        fingerprint=keyed_fingerprint(
            "a-key-the-whole-deployment-shares-0123456789", operation.input_fingerprint
        ),
    )


def test_each_migration_keeps_the_deployment_key_it_first_made(database_url: str) -> None:
    query = "SELECT fingerprint_key FROM outbox_deployment"
    (first,) = execute_admin(database_url, query)
    with psycopg.connect(database_url) as connection:
        outbox_schema.apply_schema(connection)

    assert execute_admin(database_url, query) == [first]
    assert len(first[0]) == 64
