"""The agent's write path against hostile values: headers, input outside the bounds,
its own events, hand-typed grants, what it may read.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import psycopg
import psycopg.errors
import pytest
from psycopg.types.json import Jsonb

from outbox import Registry, record_decision
from outbox import store as outbox_store
from outbox.models import ApprovalDecision, ApprovalStatus
from outbox.store import Store

from support.db_helpers import execute_admin
from support.hostile_cases import (
    AGENT,
    DEEP,
    OPERATOR,
    RECORD_DECISION,
    TRACEPARENT,
    S,
    decide,
    events_of,
    fingerprint_of,
    record_as,
    refund,
    refused,
)
from support.logins import Login
from support.ops_helpers import Ops

# --- bounds in the database, the same as in Python -------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        DEEP,
        json.dumps({"traceparent": "0" * 300_000}),
        json.dumps({"traceparent": TRACEPARENT, "x-forwarded": "1"}),
        json.dumps({"traceparent": {"nested": TRACEPARENT}}),
        json.dumps({"traceparent": TRACEPARENT, "tracestate": ["vendor=abc"]}),
        json.dumps(["not", "an", "object"]),
        json.dumps("traceparent"),
    ],
    ids=[
        "deep",
        "huge-traceparent",
        "other-header",
        "not-a-string",
        "tracestate-not-a-string",
        "array",
        "scalar",
    ],
)
def test_the_agents_write_path_refuses_headers_other_than_a_trace_context(
    login: Login, database_url: str, headers: str
) -> None:
    agent = login(AGENT)
    tool_input = refund()
    before = execute_admin(database_url, "SELECT count(*) FROM operations")

    error = refused(
        agent,
        RECORD_DECISION,
        (
            uuid.uuid4(),
            "run_poison",
            "k1",
            Jsonb(tool_input),
            fingerprint_of(tool_input),
            Jsonb(json.loads(headers)) if headers != DEEP else headers,
        ),
    )

    assert isinstance(error, psycopg.errors.CheckViolation)
    assert error.diag.constraint_name == "outbox_row_bounded"
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == before


def test_a_valid_trace_context_still_travels(login: Login, database_url: str) -> None:
    tool_input = refund()
    with psycopg.connect(login(AGENT)) as connection:
        connection.execute(
            RECORD_DECISION,
            (
                uuid.uuid4(),
                "r",
                "k",
                Jsonb(tool_input),
                fingerprint_of(tool_input),
                Jsonb({"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}),
            ),
        )
    assert execute_admin(database_url, "SELECT headers->>'traceparent' FROM outbox") == [
        (TRACEPARENT,)
    ]


@pytest.mark.parametrize(
    "tool_input",
    [
        json.dumps({"payment_id": "pay_1", "amount_cents": 1, "reason": "x" * (20 * 1024 * 1024)}),
        '{"payment_id": "pay_1", "amount_cents": 1, "reason": ' + DEEP + "}",
        '["pay_1", 1]',
    ],
    ids=["20MB", "deep", "array"],
)
def test_the_agents_write_path_refuses_input_outside_the_bounds(
    login: Login, database_url: str, tool_input: str
) -> None:
    error = refused(
        login(AGENT),
        RECORD_DECISION,
        (uuid.uuid4(), "r", "k", tool_input, "e" * 64, Jsonb({})),
    )

    assert isinstance(error, psycopg.errors.CheckViolation)
    assert error.diag.constraint_name == "operations_input_bounded"
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == [(0,)]


def test_the_prepared_event_carries_only_what_the_runtime_knows(
    login: Login, database_url: str, registry: Registry
) -> None:
    agent = login(AGENT)
    tool_input = refund()
    # Before version 6 the caller passed the event's attributes: that signature is gone.
    error = refused(
        agent,
        "SELECT id FROM outbox_record_decision(%s, 'r', 'k', 'send_refund', 1, "
        "'deduplicated_write', %s, %s, false, '{}', %s)",
        (
            uuid.uuid4(),
            Jsonb(tool_input),
            fingerprint_of(tool_input),
            Jsonb({"operation.resolved by": "ceo@example.com"}),
        ),
    )
    operation = record_as(agent, registry, refund())

    assert isinstance(error, psycopg.errors.UndefinedFunction)
    assert events_of(database_url, operation.id) == [
        ("operation.prepared", {"tool": "send_refund", "tool_version": 1, "run_id": "r"})
    ]


@pytest.mark.parametrize(
    "attributes",
    [
        '{"agent.outcome": ' + DEEP + "}",
        json.dumps({"outcome": "refund_confirmed"}),
        json.dumps({"operation.resolved by": "ceo@example.com"}),
        json.dumps({"agent.note": "x" * 5000}),
    ],
    ids=["deep", "outside-namespace", "runtime-like-key", "too-large"],
)
def test_the_agents_events_are_its_own_words_and_bounded(
    login: Login, database_url: str, ops: Ops, attributes: str
) -> None:
    operation = ops.new()

    error = refused(
        login(AGENT),
        "SELECT outbox_report_agent_completed(%s, %s::jsonb)",
        (operation.id, attributes),
    )

    assert isinstance(error, psycopg.errors.CheckViolation)
    assert [n for n, _ in events_of(database_url, operation.id)] == ["operation.prepared"]
    assert execute_admin(database_url, "SELECT count(*) FROM agent_reports") == [(0,)]


# --- approvals: a grant writes its event, at the database's clock, for at most 7 days --


def test_a_hand_typed_grant_is_evidence_and_cannot_outrank_a_later_denial(
    login: Login, database_url: str, ops: Ops
) -> None:
    operator = login(OPERATOR)
    waiting = ops.new(amount_cents=60_000)
    insert = (
        "INSERT INTO approvals (id, operation_id, intent_hash, approved_by, expires_at{extra}) "
        "VALUES (gen_random_uuid(), %s, %s, 'mallory@example.com', {expires}{value})"
    )
    for extra, expires, value, kind in (
        (
            ", created_at",
            "now() + interval '1 hour'",
            ", '2999-01-01'",
            psycopg.errors.InsufficientPrivilege,
        ),
        ("", "'infinity'", "", psycopg.errors.CheckViolation),
        ("", "now() + interval '30 days'", "", psycopg.errors.CheckViolation),
    ):
        error = refused(
            operator,
            insert.format(extra=extra, expires=expires, value=value),
            (waiting.id, waiting.input_fingerprint),
        )
        assert isinstance(error, kind), (extra, expires)

    with psycopg.connect(operator) as connection:
        connection.execute(
            insert.format(extra="", expires="now() + interval '1 hour'", value=""),
            (waiting.id, waiting.input_fingerprint),
        )
    granted = ops.run(outbox_store.check_approval(waiting.id))
    decide(ops, waiting.id, ApprovalDecision.DENIED, timedelta(minutes=15))

    assert granted.status is ApprovalStatus.VALID
    assert [(n, a.get("by")) for n, a in events_of(database_url, waiting.id)][1:] == [
        ("operation.approval_granted", "mallory@example.com"),
        ("operation.approval_denied", "lead@example.com"),
    ]
    assert ops.run(outbox_store.check_approval(waiting.id)).status is ApprovalStatus.DENIED


def test_a_grant_longer_than_the_policy_is_refused_before_the_database(ops: Ops) -> None:
    waiting = ops.new(amount_cents=60_000)
    with pytest.raises(ValueError, match="at most 7 days"):
        decide(ops, waiting.id, ApprovalDecision.GRANTED, timedelta(days=8))


# --- what the agent may read -----------------------------------------------------------


def test_the_agent_reads_neither_inputs_nor_who_approved(
    login: Login, database_url: str, registry: Registry, ops: Ops
) -> None:
    agent = login(AGENT)
    mine = record_as(agent, registry, refund(amount_cents=60_000, reason="for the agent only"))
    decide(ops, mine.id, ApprovalDecision.DENIED, timedelta(minutes=15))

    for statement in ("SELECT input FROM operations", "SELECT approved_by FROM approvals"):
        assert isinstance(refused(agent, statement), psycopg.errors.InsufficientPrivilege)
    # What it needs still works: recording again, and asking how an approval stands.
    again = record_as(agent, registry, refund())
    with psycopg.connect(agent) as connection:
        same = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "p", "amount_cents": 5},
            run_id="r",
            decision_key="k",
        )
        repeated = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "p", "amount_cents": 5},
            run_id="r",
            decision_key="k",
        )
        check = Store(connection).run(outbox_store.check_approval(mine.id))
    assert again.state is S.PREPARED
    assert (same.created, repeated.created) == (True, False)
    assert repeated.operation.input == {
        "payment_id": "p",
        "amount_cents": 5,
        "currency": "EUR",
        "reason": "",
    }
    assert check.status is ApprovalStatus.DENIED
    assert "lead@example.com" not in check.reason
    assert check.approval is not None
    assert check.approval.approved_by is None
