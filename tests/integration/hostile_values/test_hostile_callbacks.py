"""The callbacks path against hostile values and roles."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import psycopg.errors
import pytest

from support.db_helpers import execute_admin
from support.hostile_cases import AGENT, CALLBACKS, CONSUMER, S, refused
from support.logins import Login
from support.ops_helpers import Ops

# --- the callbacks role: one write path, every value bounded (schema version 7) --------

RECORD_CALLBACK = "SELECT * FROM outbox_record_callback(%s, %s, %s, %s, %s, %s)"
DIGEST = "c" * 64
REFERENCE_CHECK = "callbacks_provider_reference_check"
DIGEST_CHECK = "callbacks_payload_digest_check"


def callbacks_rows(database_url: str) -> list[tuple[Any, ...]]:
    return execute_admin(database_url, "SELECT * FROM callbacks ORDER BY id")


def test_the_callbacks_role_chooses_no_id_time_or_outcome(
    login: Login, database_url: str, ops: Ops
) -> None:
    receiver = login(CALLBACKS)
    operation = ops.at(S.OUTCOME_UNKNOWN)
    [(before,)] = execute_admin(database_url, "SELECT clock_timestamp()")

    with psycopg.connect(receiver) as connection:
        connection.execute(
            RECORD_CALLBACK, ("payments", "evt_1", "committed", operation.id, "re_1", DIGEST)
        )
    [(after,)] = execute_admin(database_url, "SELECT clock_timestamp()")
    # Its only privilege is the function: no column of the inbox is its to name.
    error = refused(
        receiver,
        "INSERT INTO callbacks (id, provider, event_id, status, payload_digest, received_at, "
        "outcome, applied_at) OVERRIDING SYSTEM VALUE VALUES (1, 'payments', 'evt_2', "
        "'committed', repeat('0', 64), now() - interval '1 day', 'settled', now())",
    )

    assert isinstance(error, psycopg.errors.InsufficientPrivilege)
    [(received_at, outcome, applied_at)] = execute_admin(
        database_url, "SELECT received_at, outcome, applied_at FROM callbacks"
    )
    assert before <= received_at <= after
    assert (outcome, applied_at) == (None, None)
    # It moved nothing: the operation is still the reconciler's to settle.
    assert ops.get(operation.id).state is S.OUTCOME_UNKNOWN


@pytest.mark.parametrize(
    ("arguments", "constraint"),
    [
        (("Payments", "evt", "committed", None, None, DIGEST), "callbacks_provider_check"),
        (("pay/ments", "evt", "committed", None, None, DIGEST), "callbacks_provider_check"),
        (("payments", "evt\x1b[2J", "committed", None, None, DIGEST), "callbacks_event_id_check"),
        (("payments", "evt 1", "committed", None, None, DIGEST), "callbacks_event_id_check"),
        (("payments", "e" * 256, "committed", None, None, DIGEST), "callbacks_event_id_check"),
        (("payments", "", "committed", None, None, DIGEST), "callbacks_event_id_check"),
        (("payments", "evt", "settled", None, None, DIGEST), "callbacks_status_check"),
        (
            ("payments", "evt", "committed", None, "r" * 501, DIGEST),
            "callbacks_provider_reference_check",
        ),
        (
            ("payments", "evt", "committed", None, "re\r\n1", DIGEST),
            "callbacks_provider_reference_check",
        ),
        (("payments", "evt", "committed", None, "", DIGEST), "callbacks_provider_reference_check"),
        (
            ("payments", "evt", "committed", None, None, "<script>"),
            "callbacks_payload_digest_check",
        ),
    ],
)
def test_the_callbacks_role_is_refused_every_value_outside_the_bounds(
    login: Login, database_url: str, arguments: tuple[Any, ...], constraint: str
) -> None:
    receiver = login(CALLBACKS)

    error = refused(receiver, RECORD_CALLBACK, arguments)

    assert isinstance(error, psycopg.errors.CheckViolation)
    assert error.diag.constraint_name == constraint
    assert callbacks_rows(database_url) == []


def test_a_shadowed_operations_table_does_not_fool_the_callback_path(
    login: Login, database_url: str, ops: Ops
) -> None:
    # TEMPORARY granted back, as a deployment may: the pinned search_path holds alone.
    receiver = login(CALLBACKS, temporary=True)
    operation = ops.at(S.OUTCOME_UNKNOWN)
    ghost = uuid.uuid4()

    with psycopg.connect(receiver) as connection:
        connection.execute(
            "CREATE TEMP TABLE operations (id uuid, provider_reference text, "
            "created_at timestamptz)"
        )
        connection.execute("INSERT INTO operations VALUES (%s, 're_ghost', now())", (ghost,))
        ghostly = connection.execute(
            RECORD_CALLBACK, ("payments", "evt_1", "committed", ghost, None, DIGEST)
        ).fetchone()
        real = connection.execute(
            RECORD_CALLBACK, ("payments", "evt_2", "committed", operation.id, None, DIGEST)
        ).fetchone()

    assert ghostly is not None
    assert real is not None
    assert (ghostly[1], ghostly[2]) == ("unmatched", None)
    assert (real[1], real[2]) == ("recorded", operation.id)


def test_the_consumer_sets_a_callbacks_outcome_once_and_nothing_else(
    login: Login, database_url: str, ops: Ops
) -> None:
    consumer = login(CONSUMER)
    operation = ops.at(S.COMMITTED)
    execute_admin(
        database_url,
        RECORD_CALLBACK,
        ("payments", "evt_1", "committed", operation.id, "re_found", DIGEST),
    )

    with psycopg.connect(consumer) as connection:
        connection.execute("UPDATE callbacks SET outcome = 'confirmed'")
    applied = callbacks_rows(database_url)
    second = refused(consumer, "UPDATE callbacks SET outcome = 'settled'")
    cleared = refused(consumer, "UPDATE callbacks SET outcome = NULL")
    rewritten = refused(consumer, "UPDATE callbacks SET provider_reference = 're_other'")
    backdated = refused(consumer, "UPDATE callbacks SET applied_at = now() - interval '1 day'")
    # The owner too: what a provider reported is frozen for everyone.
    frozen = refused(database_url, "UPDATE callbacks SET status = 'rejected'")

    assert isinstance(second, psycopg.errors.CheckViolation)
    assert isinstance(cleared, psycopg.errors.CheckViolation)
    assert isinstance(rewritten, psycopg.errors.InsufficientPrivilege)
    assert isinstance(backdated, psycopg.errors.InsufficientPrivilege)
    assert isinstance(frozen, psycopg.errors.InsufficientPrivilege)
    assert "callbacks_evidence_frozen" in str(frozen.diag.constraint_name)
    assert callbacks_rows(database_url) == applied
    assert applied[0][-2:][0] == "confirmed"


@pytest.mark.parametrize("group", [AGENT, CONSUMER])
def test_no_component_forges_a_callback_received_event(
    login: Login, database_url: str, ops: Ops, group: str
) -> None:
    attacker = login(group)
    operation = ops.at(S.OUTCOME_UNKNOWN)

    error = refused(
        attacker,
        "INSERT INTO operation_events (operation_id, name, attributes) VALUES "
        "(%s, 'operation.callback_received', '{\"status\": \"committed\"}')",
        (operation.id,),
    )

    assert isinstance(error, psycopg.errors.InsufficientPrivilege)
    assert "operation.callback_received" not in ops.event_names(operation.id)
