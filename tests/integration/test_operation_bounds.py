"""An operation's bounds (schema version 18): checked by its two guards instead of the ten
CHECK constraints Postgres prepared again for every statement that wrote the table. A
row out of bounds is refused as the constraint refused it (check_violation, the same
constraint name) and nothing is written; a version 17 database loses the constraints on
migrating and keeps every bound."""

from __future__ import annotations

from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest

from outbox import Registry
from outbox import schema as outbox_schema

from support.db_helpers import execute_admin, migrate_again
from support.ops_helpers import Ops

FINGERPRINT = "ab" * 32
GOOD_ROW: dict[str, Any] = {
    "run_id": "bounds",
    "decision_key": "k",
    "tool_name": "send_refund",
    "tool_version": 1,
    "side_effect": "deduplicated_write",
    "input_fingerprint": FINGERPRINT,
}
INSERT = (
    "INSERT INTO operations (id, run_id, decision_key, tool_name, tool_version, side_effect, "
    "input, input_fingerprint) VALUES (%(id)s, %(run_id)s, %(decision_key)s, %(tool_name)s, "
    "%(tool_version)s, %(side_effect)s, '{}', %(input_fingerprint)s)"
)
# The constraints of version 17, as its CREATE TABLE made them.
VERSION_17_CHECKS = """
ALTER TABLE operations
    ADD CONSTRAINT operations_run_id_check CHECK (length(run_id) BETWEEN 1 AND 200),
    ADD CONSTRAINT operations_tool_name_check CHECK (tool_name ~ '^[a-z][a-z0-9_.-]{0,63}$'),
    ADD CONSTRAINT operations_state_check CHECK (state IN
        ('prepared', 'in_flight', 'committed', 'rejected', 'outcome_unknown', 'escalated')),
    ADD CONSTRAINT operations_lease_consistent CHECK (
        (lease_owner IS NULL) = (lease_expires_at IS NULL)
        AND (state <> 'in_flight' OR lease_expires_at IS NOT NULL)
        AND (state IN ('in_flight', 'outcome_unknown') OR lease_expires_at IS NULL))
"""
ROW = "SELECT * FROM operations WHERE id = %s"
CHECKS_ON_OPERATIONS = (
    "SELECT count(*) FROM pg_constraint WHERE conrelid = 'operations'::regclass AND contype = 'c'"
)


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def refused_as(database_url: str, sql: str, params: dict[str, Any]) -> str | None:
    """The constraint a statement, run as the tables' owner, was refused by."""
    with pytest.raises(psycopg.errors.CheckViolation) as refused:
        execute_admin_named(database_url, sql, params)
    return refused.value.diag.constraint_name


def execute_admin_named(database_url: str, sql: str, params: dict[str, Any]) -> None:
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute(sql, params)


def count_operations(database_url: str, operation_id: UUID) -> int:
    found = execute_admin(
        database_url, "SELECT count(*) FROM operations WHERE id = %s", (operation_id,)
    )
    return int(found[0][0])


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("run_id", "", "operations_run_id_check"),
        ("run_id", "r" * 201, "operations_run_id_check"),
        ("decision_key", "", "operations_decision_key_check"),
        ("tool_name", "Send_Refund", "operations_tool_name_check"),
        ("tool_name", "send refund", "operations_tool_name_check"),
        ("tool_version", 0, "operations_tool_version_check"),
        ("side_effect", "maybe", "operations_side_effect_check"),
        ("input_fingerprint", FINGERPRINT.upper(), "operations_input_fingerprint_check"),
        ("input_fingerprint", FINGERPRINT[:-1], "operations_input_fingerprint_check"),
        ("input_fingerprint", FINGERPRINT + "\n", "operations_input_fingerprint_check"),
    ],
)
def test_an_intent_out_of_bounds_is_refused_at_its_insert_by_the_constraints_name(
    database_url: str, column: str, value: Any, constraint: str
) -> None:
    operation_id = uuid4()
    row = {**GOOD_ROW, "id": operation_id, column: value}

    assert refused_as(database_url, INSERT, row) == constraint
    assert count_operations(database_url, operation_id) == 0


def test_an_intent_within_bounds_is_inserted(database_url: str) -> None:
    operation_id = uuid4()
    execute_admin_named(
        database_url, INSERT, {**GOOD_ROW, "id": operation_id, "decision_key": None}
    )

    assert count_operations(database_url, operation_id) == 1


@pytest.mark.parametrize(
    ("assignments", "constraint"),
    [
        ("attempts = -1", "operations_attempts_check"),
        ("reconcile_attempts = -1", "operations_reconcile_attempts_check"),
        ("lease_owner = 'w'", "operations_lease_consistent"),
        ("lease_expires_at = now() + interval '1 minute'", "operations_lease_consistent"),
        # A legal edge, but a worker talking to the provider always holds a lease.
        ("state = 'in_flight'", "operations_lease_consistent"),
    ],
)
def test_a_move_out_of_bounds_is_refused_by_the_constraints_name_and_changes_nothing(
    ops: Ops, database_url: str, assignments: str, constraint: str
) -> None:
    operation = ops.new()
    before = execute_admin(
        database_url, "SELECT operations.* FROM operations WHERE id = %s", (operation.id,)
    )

    refused = refused_as(
        database_url, f"UPDATE operations SET {assignments} WHERE id = %(id)s", {"id": operation.id}
    )

    assert refused == constraint
    after = execute_admin(
        database_url, "SELECT operations.* FROM operations WHERE id = %s", (operation.id,)
    )
    assert after == before


def test_a_claimed_operation_holds_its_lease_within_bounds(ops: Ops, database_url: str) -> None:
    operation = ops.new()
    execute_admin_named(
        database_url,
        "UPDATE operations SET state = 'in_flight', lease_owner = 'w', "
        "lease_expires_at = now() + interval '1 minute' WHERE id = %(id)s",
        {"id": operation.id},
    )

    assert (
        refused_as(
            database_url,
            "UPDATE operations SET lease_owner = NULL WHERE id = %(id)s",
            {"id": operation.id},
        )
        == "operations_lease_consistent"
    )
    assert ops.get(operation.id).state == "in_flight"


def test_no_check_constraint_is_left_for_each_statement_to_prepare(database_url: str) -> None:
    assert execute_admin(database_url, CHECKS_ON_OPERATIONS) == [(0,)]


def test_a_version_17_database_loses_its_constraints_and_keeps_its_bounds(
    ops: Ops, database_url: str
) -> None:
    operation = ops.new()
    execute_admin(
        database_url,
        VERSION_17_CHECKS + "; DROP FUNCTION outbox_operation_state_refused"
        "(text, integer, integer, text, timestamptz)"
        "; DELETE FROM outbox_schema_version WHERE version = 18"
        # As another schema.sql applied it: the migration runs again.
        "; UPDATE outbox_schema_applied SET digest = repeat('0', 64)",
    )
    told_to_migrate, migrated, current = migrate_again(database_url)

    assert told_to_migrate
    assert (migrated, current) == (outbox_schema.SCHEMA_VERSION, True)
    assert execute_admin(database_url, CHECKS_ON_OPERATIONS) == [(0,)]
    assert (
        refused_as(
            database_url,
            "UPDATE operations SET attempts = -1 WHERE id = %(id)s",
            {"id": operation.id},
        )
        == "operations_attempts_check"
    )
    assert (
        refused_as(database_url, INSERT, {**GOOD_ROW, "id": uuid4(), "tool_name": "Bad"})
        == "operations_tool_name_check"
    )


def test_a_row_refused_for_a_guards_own_reason_still_says_that_reason(
    ops: Ops, database_url: str
) -> None:
    # The bounds are checked last, where the constraints were (after every BEFORE
    # trigger): an illegal move that also breaks a bound is named as the illegal move.
    operation = ops.new()

    refused = refused_as(
        database_url,
        "UPDATE operations SET state = 'committed', attempts = -1 WHERE id = %(id)s",
        {"id": operation.id},
    )

    assert refused == "operations_legal_transition"
