"""A decision recorded at REPEATABLE READ or SERIALIZABLE while its key's operation moves
to history (docs/design.md section 15, "The race between the probe and the insert"): the
agent's snapshot is older than the move, so neither of outbox_record_decision's looks
at the key generations sees the key. The decision is never recorded twice: it gets the
archived operation back, or a serialization failure its retry answers with it.

The interleavings are held with the move's open transaction and the agent's own
snapshot, and waited for on pg_stat_activity: no sleeps."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from outbox import OperationState, RecordedDecision, Registry, record_decision
from outbox import store as outbox_store
from outbox.errors import TransientDatabaseError
from outbox.store import Store

from support.db_helpers import execute_admin
from support.history_helpers import HOT, settled_days_ago, wait_for_lock_waiters
from support.ops_helpers import Ops

S = OperationState
RUN = "run-history-isolation"
LEVELS = [
    psycopg.IsolationLevel.READ_COMMITTED,
    psycopg.IsolationLevel.REPEATABLE_READ,
    psycopg.IsolationLevel.SERIALIZABLE,
]


def decide(connection: psycopg.Connection[Any], registry: Registry, key: str) -> RecordedDecision:
    return record_decision(
        connection,
        registry,
        "send_refund",
        {"payment_id": "pay_1", "amount_cents": 100, "reason": ""},
        run_id=RUN,
        decision_key=key,
    )


def settled_operation(database_url: str, registry: Registry, key: str) -> Any:
    """The key's operation, committed two days ago and published: the next move takes it."""
    ops = Ops(database_url, registry)
    with psycopg.connect(database_url) as connection:
        first = decide(connection, registry, key)
    operation = ops.move(ops.move(first.operation, S.IN_FLIGHT), S.COMMITTED)
    settled_days_ago(database_url, operation.id, 2)
    return operation


def agent_session(database_url: str, level: psycopg.IsolationLevel) -> psycopg.Connection[Any]:
    """An agent's session whose transaction has taken its snapshot already (its first
    statement reads a table), as a service that read its own state first would have."""
    connection = psycopg.connect(database_url)
    connection.isolation_level = level
    connection.execute("SELECT count(*) FROM outbox_deployment")
    return connection


def operations_of_the_run(database_url: str) -> int:
    return int(
        execute_admin(database_url, "SELECT count(*) FROM operations WHERE run_id = %s", (RUN,))[0][
            0
        ]
    )


def assert_retry_gets_the_archived_one(
    database_url: str, registry: Registry, level: psycopg.IsolationLevel, key: str, archived: Any
) -> None:
    with psycopg.connect(database_url) as connection:
        connection.isolation_level = level
        again = decide(connection, registry, key)
    assert again.created is False
    assert again.operation.id == archived.id
    assert operations_of_the_run(database_url) == 0


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
def test_a_decision_whose_snapshot_predates_a_committed_move_is_refused_then_answered(
    database_url: str, registry: Registry, level: psycopg.IsolationLevel
) -> None:
    key = f"before-{level.name}"
    operation = settled_operation(database_url, registry, key)
    agent = agent_session(database_url, level)
    try:
        # The move commits after the agent's snapshot and before its decision.
        with psycopg.connect(database_url) as mover:
            assert Store(mover).run(outbox_store.archive_batch(HOT, 10))
        if level == psycopg.IsolationLevel.READ_COMMITTED:
            # Each statement sees what committed before it: the first look finds the key.
            found = decide(agent, registry, key)
            assert found.created is False
            assert found.operation.id == operation.id
        else:
            with pytest.raises(TransientDatabaseError, match="SQLSTATE 40001"):
                decide(agent, registry, key)
        agent.rollback()
    finally:
        agent.close()

    assert_retry_gets_the_archived_one(database_url, registry, level, key, operation)


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name)
def test_a_decision_waiting_on_a_move_in_progress_is_refused_then_answered(
    database_url: str, registry: Registry, level: psycopg.IsolationLevel
) -> None:
    key = f"during-{level.name}"
    operation = settled_operation(database_url, registry, key)
    agent = agent_session(database_url, level)
    outcome: dict[str, Any] = {}

    def record() -> None:
        try:
            outcome["recorded"] = decide(agent, registry, key)
        except Exception as error:  # the test judges it
            outcome["error"] = error

    try:
        # The move has deleted the hot row and written the key, and not committed: the
        # decision's insert waits on the deleted row's index entry until the move ends.
        with psycopg.connect(database_url) as mover:
            assert Store(mover).run(outbox_store.archive_batch(HOT, 10))
            racer = threading.Thread(target=record)
            racer.start()
            wait_for_lock_waiters(
                database_url,
                "the decision waiting for the move",
                running="%outbox_record_decision%",
            )
        racer.join(10)
        assert not racer.is_alive()
        agent.rollback()
    finally:
        agent.close()

    assert isinstance(outcome.get("error"), TransientDatabaseError), outcome
    assert "SQLSTATE 40001" in str(outcome["error"])
    assert_retry_gets_the_archived_one(database_url, registry, level, key, operation)


@pytest.mark.parametrize("level", LEVELS[1:], ids=lambda level: level.name)
def test_a_move_after_the_decision_found_its_key_leaves_one_operation(
    database_url: str, registry: Registry, level: psycopg.IsolationLevel
) -> None:
    """The other order: the decision finds the hot row first (created=False) and its
    transaction is still open when the move takes the row away."""
    key = f"after-{level.name}"
    operation = settled_operation(database_url, registry, key)
    agent = agent_session(database_url, level)
    try:
        found = decide(agent, registry, key)
        with psycopg.connect(database_url) as mover:
            moved = Store(mover).run(outbox_store.archive_batch(HOT, 10))
        agent.commit()
    finally:
        agent.close()

    assert found.created is False
    assert found.operation.id == operation.id
    assert [checkpoint.operations for checkpoint in moved] == [1]
    assert_retry_gets_the_archived_one(database_url, registry, level, key, operation)
