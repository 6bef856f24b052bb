"""What a decision key row holds once its operation moved to history (schema version 17,
docs/operating.md "History retention"): the operation's columns the agent reads back,
typed, never its input. A retried decision and an awaited outcome answered from the key
mean what they meant while the operation was hot; a version 16 database's key rows (the
operation row as jsonb) stay readable after the migration, until their generation is
cleared."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.errors
import pytest

from outbox import (
    Operation,
    OperationState,
    Outcome,
    RecordedDecision,
    Registry,
    await_outcome,
    await_outcome_sync,
    get_outcome,
)
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.errors import DecisionConflict
from outbox.models import ApprovalDecision

from support import history_helpers
from support.db_helpers import execute_admin
from support.history_helpers import archive_all, settled_days_ago
from support.ops_helpers import LEASE, Ops

S = OperationState
RUN = "run-history-keys"

# What a version 17 key row holds besides its key, the operation's id and its day.
KEPT = {
    "tool_name",
    "tool_version",
    "side_effect",
    "fingerprint",
    "requires_approval",
    "state",
    "attempts",
    "reconcile_attempts",
    "lease_token",
    "next_attempt_at",
    "first_attempt_at",
    "provider_reference",
    "result",
    "last_error_class",
    "effect_possible",
    "created_at",
    "updated_at",
}


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


decided = functools.partial(history_helpers.decided, run_id=RUN, reason="kept out")


def moved(ops: Ops, operation: Operation, target: OperationState, **fields: Any) -> Operation:
    """``operation`` moved on to ``target`` under its own lease, as a worker moves it."""
    after: Operation = ops.run(
        outbox_store.transition(
            operation.id,
            source=operation.state,
            target=target,
            lease_token=operation.lease_token,
            **fields,
        )
    )
    return after


def committed(ops: Ops, operation: Operation) -> Operation:
    return moved(
        ops,
        ops.move(operation, S.IN_FLIGHT),
        S.COMMITTED,
        provider_reference="re_kept",
        result={"refund_id": "re_kept", "amount": {"cents": 100, "exact": 1.50}},
    )


def rejected(ops: Ops, operation: Operation) -> Operation:
    return moved(ops, ops.move(operation, S.IN_FLIGHT), S.REJECTED, error_class="card_declined")


def reconciled(ops: Ops, operation: Operation) -> Operation:
    """Its outcome unknown, looked up after a delay and found committed: the effect was
    possible, and its next attempt was due later than it was created."""
    claimed = ops.move(operation, S.IN_FLIGHT)
    unknown = moved(ops, claimed, S.OUTCOME_UNKNOWN, delay=timedelta(seconds=30))
    return moved(
        ops, unknown, S.COMMITTED, provider_reference="re_looked_up", reconcile_attempt=True
    )


Settle = Callable[[Ops, Operation], Operation]
SHAPES: dict[str, tuple[int, Settle]] = {
    "committed": (100, committed),
    "rejected": (100, rejected),
    "reconciled": (100, reconciled),
    # Above the contract's threshold: granted, then committed.
    "approved": (90_000, committed),
}


def settled_under(ops: Ops, registry: Registry, key: str, shape: str) -> Operation:
    amount, settle = SHAPES[shape]
    operation = decided(ops.database_url, registry, key, amount).operation
    if operation.requires_approval:
        ops.run(
            outbox_store.decide_approval(
                operation.id,
                decision=ApprovalDecision.GRANTED,
                approved_by="lead@example.com",
                ttl=LEASE,
            )
        )
    return settle(ops, operation)


def outcomes(database_url: str, recorded: RecordedDecision) -> list[Outcome]:
    """Every way an agent reads one outcome: by id and by its key, once and awaited."""
    operation_id = recorded.operation.id
    with psycopg.connect(database_url) as connection:
        once = get_outcome(connection, operation_id)
    by_key = asyncio.run(await_outcome(database_url, recorded, timeout=5))
    return [once, by_key, await_outcome_sync(database_url, operation_id, timeout=5)]


def key_row(database_url: str, key: str) -> dict[str, Any]:
    rows = execute_admin(
        database_url,
        "SELECT to_jsonb(g) FROM (SELECT * FROM history_keys_0 UNION ALL "
        "SELECT * FROM history_keys_1) g WHERE g.run_id = %s AND g.decision_key = %s",
        (RUN, key),
    )
    assert len(rows) == 1
    row: dict[str, Any] = rows[0][0]
    return row


def archived(ops: Ops, *operations: Operation) -> None:
    for operation in operations:
        settled_days_ago(ops.database_url, operation.id, 3)
    archive_all(ops)


# --- what a retry and an awaited outcome get back --------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_a_retry_and_an_outcome_answered_from_the_key_mean_what_they_meant_hot(
    ops: Ops, database_url: str, registry: Registry, shape: str
) -> None:
    key = f"refund-{shape}"
    settled = settled_under(ops, registry, key, shape)
    settled_days_ago(database_url, settled.id, 3)
    hot = decided(database_url, registry, key, SHAPES[shape][0])
    hot_outcomes = outcomes(database_url, hot)
    archive_all(ops)

    again = decided(database_url, registry, key, SHAPES[shape][0])

    assert key_row(database_url, key)["operation"] is None  # a version 17 row
    assert (hot.created, again.created) == (False, False)
    assert again.operation == hot.operation
    assert again.operation.state is settled.state
    assert again.operation.effect_possible is (shape == "reconciled")
    assert again.operation.requires_approval is (shape == "approved")
    assert outcomes(database_url, again) == hot_outcomes
    assert hot_outcomes[0].final


def test_a_key_row_holds_the_operations_columns_and_never_its_input(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    operation = settled_under(ops, registry, "refund-row", "committed")
    archived(ops, operation)

    row = key_row(database_url, "refund-row")
    fingerprint = execute_admin(
        database_url,
        "SELECT encode(fingerprint, 'hex') FROM history_keys_0 WHERE operation_id = %s "
        "UNION ALL SELECT encode(fingerprint, 'hex') FROM history_keys_1 "
        "WHERE operation_id = %s",
        (operation.id, operation.id),
    )

    assert set(row) == {"run_id", "decision_key", "operation_id", "settled_on", "operation", *KEPT}
    assert row["operation"] is None
    assert fingerprint == [(operation.input_fingerprint,)]
    assert (row["state"], row["provider_reference"]) == ("committed", "re_kept")
    assert row["lease_token"] == operation.lease_token
    assert "pay_refund-row" not in str(row)
    assert "kept out" not in str(row)


@pytest.mark.parametrize(
    ("what", "columns"),
    [
        ("nothing of the operation", ""),
        (
            "an operation that is not settled",
            ", created_at, updated_at, next_attempt_at, lease_token, tool_version, attempts, "
            "reconcile_attempts, requires_approval, effect_possible, state, tool_name, "
            "side_effect, fingerprint",
        ),
    ],
)
def test_a_key_row_without_what_version_16_keeps_is_refused(
    database_url: str, what: str, columns: str
) -> None:
    values = (
        ", now(), now(), now(), 1, 1, 1, 0, false, false, 'prepared', 'send_refund', "
        "'deduplicated_write', sha256('x')"
        if columns
        else ""
    )
    for generation in ("history_keys_0", "history_keys_1"):
        with pytest.raises(psycopg.errors.CheckViolation, match=f"{generation}_row"):
            execute_admin(
                database_url,
                f"INSERT INTO {generation} (run_id, decision_key, operation_id, settled_on"
                f"{columns}) VALUES ('r', 'k', gen_random_uuid(), current_date{values})",
            )


# --- a version 16 database's key rows ------------------------------------------------


def as_version_16(database_url: str) -> None:
    """As a version 16 database looks, with the key rows its archive wrote: each one the
    operation row without its input as jsonb (history's row is the operation as the same
    move read it), no typed columns, no reader of them; no version 17."""
    execute_admin(
        database_url,
        "UPDATE history_keys_0 g SET operation = h.operation - 'input' FROM history h "
        "WHERE h.operation_id = g.operation_id;"
        "UPDATE history_keys_1 g SET operation = h.operation - 'input' FROM history h "
        "WHERE h.operation_id = g.operation_id;"
        "DROP FUNCTION outbox_history_key_operation(history_keys_0);"
        "DROP FUNCTION outbox_history_key_operation(history_keys_1);"
        "UPDATE outbox_schema_applied SET digest = repeat('0', 64);"
        "DELETE FROM outbox_schema_version WHERE version = 17",
    )
    for generation in ("history_keys_0", "history_keys_1"):
        dropped = ", ".join(f"DROP COLUMN {column}" for column in sorted(KEPT))
        execute_admin(
            database_url,
            f"ALTER TABLE {generation} DROP CONSTRAINT {generation}_row, {dropped}, "
            "ALTER COLUMN operation SET NOT NULL",
        )


def test_a_version_16_databases_key_rows_answer_as_before_after_the_migration(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    keys = {"committed": "refund-old-kept", "rejected": "refund-old-declined"}
    settled = {shape: settled_under(ops, registry, key, shape) for shape, key in keys.items()}
    for operation in settled.values():
        settled_days_ago(database_url, operation.id, 3)
    hot = {shape: decided(database_url, registry, key) for shape, key in keys.items()}
    hot_outcomes = {shape: outcomes(database_url, hot[shape]) for shape in keys}
    archive_all(ops)
    as_version_16(database_url)
    with psycopg.connect(database_url) as connection:
        told_to_migrate = not outbox_schema.schema_is_current(connection)

    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
    with psycopg.connect(database_url) as connection:
        current = outbox_schema.schema_is_current(connection)
    again = {shape: decided(database_url, registry, key) for shape, key in keys.items()}
    with pytest.raises(DecisionConflict, match="decision key already recorded"):
        decided(database_url, registry, keys["committed"], amount=999)
    # A move after the migration writes a version 17 row beside the older ones.
    newer = settled_under(ops, registry, "refund-new", "committed")
    archived(ops, newer)

    assert told_to_migrate
    assert current
    for shape, key in keys.items():
        assert key_row(database_url, key)["operation"] is not None  # left as it was
        assert again[shape].created is False
        assert again[shape].operation == hot[shape].operation
        assert outcomes(database_url, again[shape]) == hot_outcomes[shape]
    assert key_row(database_url, "refund-new")["operation"] is None
    assert decided(database_url, registry, "refund-new").operation.id == newer.id
    assert execute_admin(
        database_url, "SELECT count(*) FROM operations WHERE run_id = %s", (RUN,)
    ) == [(0,)]


def test_the_older_rows_leave_with_their_generation(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    old = settled_under(ops, registry, "refund-rotated", "committed")
    archived(ops, old)
    as_version_16(database_url)
    with psycopg.connect(database_url) as connection:
        outbox_schema.apply_schema(connection)
    newer = settled_under(ops, registry, "refund-after", "committed")
    archived(ops, newer)

    # The empty generation first, then the one holding both rows: each rotation clears
    # the older generation once every key in it is older than the retention.
    rotations = [ops.run(outbox_store.rotate_keys(timedelta(days=1))) for _ in range(2)]
    again = decided(database_url, registry, "refund-rotated")

    assert rotations == [True, True]
    assert execute_admin(
        database_url,
        "SELECT (SELECT count(*) FROM history_keys_0) + (SELECT count(*) FROM history_keys_1)",
    ) == [(0,)]
    assert again.created is True  # the key's window is over: a new decision
