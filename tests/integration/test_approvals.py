from __future__ import annotations

from datetime import timedelta
from uuid import uuid4

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import (
    ApprovalStatus,
    Operation,
    OperationNotFound,
    OutcomeStatus,
    Registry,
    check_approval,
    check_approval_async,
    get_outcome,
    grant_approval,
    grant_approval_async,
    record_decision,
)
from outbox import store as outbox_store
from outbox.fingerprint_key import keyed_fingerprint
from outbox.models import ApprovalDecision
from outbox.store import Store

from support.db_helpers import committed_counts, execute_admin

LARGE_REFUND = {"payment_id": "pay_9", "amount_cents": 75_000}
TTL = timedelta(minutes=15)


def record(engine: sa.Engine, registry: Registry, **overrides: int) -> Operation:
    with engine.begin() as connection:
        recorded = record_decision(
            connection, registry, "send_refund", {**LARGE_REFUND, **overrides}, run_id="run"
        )
    assert recorded.operation.requires_approval
    return recorded.operation


def test_a_valid_grant_is_accepted_and_queues_the_operation_again(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    operation = record(engine, registry)
    with engine.begin() as connection:
        assert check_approval(connection, operation.id).status is ApprovalStatus.MISSING
        grant = grant_approval(connection, operation.id, approved_by="oncall@example.com", ttl=TTL)
    with engine.connect() as connection:
        check = check_approval(connection, operation.id)
    with psycopg.connect(database_url) as connection:
        rows = Store(connection).run(outbox_store.outbox_rows(operation.id))
        events = Store(connection).run(outbox_store.events(operation.id))

    assert check.status is ApprovalStatus.VALID
    assert check.is_valid
    # What the agent (and the consumer) reads names nobody: who decided is for operators.
    assert check.approval == grant.model_copy(update={"approved_by": None})
    assert grant.approved_by == "oncall@example.com"
    assert grant.intent_hash == operation.input_fingerprint
    assert "oncall@example.com" not in check.reason
    assert len(rows) == 2
    assert events[-1].name == "operation.approval_granted"
    assert events[-1].attributes["approval_id"] == str(grant.id)
    assert events[-1].attributes["by"] == "oncall@example.com"


def test_a_grant_rolled_back_leaves_no_grant_no_outbox_row_no_event(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    operation = record(engine, registry)
    with engine.connect() as connection:
        grant_approval(connection, operation.id, approved_by="a@example.com", ttl=TTL)
        connection.rollback()
    with engine.connect() as connection:
        assert check_approval(connection, operation.id).status is ApprovalStatus.MISSING
    counts = committed_counts(database_url)
    assert (counts.outbox, counts.events) == (1, 1)


def test_an_expired_grant_is_refused_with_its_expiry(engine: sa.Engine, registry: Registry) -> None:
    operation = record(engine, registry)
    with engine.begin() as connection:
        grant_approval(
            connection, operation.id, approved_by="a@example.com", ttl=timedelta(microseconds=1)
        )
    # A later transaction's clock is past a grant that lived one microsecond.
    with engine.begin() as connection:
        check = check_approval(connection, operation.id)

    assert check.status is ApprovalStatus.EXPIRED
    assert "expired at" in check.reason


def test_a_grant_for_another_intent_is_refused(
    engine: sa.Engine, registry: Registry, database_url: str
) -> None:
    operation = record(engine, registry)
    other = record(engine, registry, amount_cents=80_000)
    with engine.begin() as connection:
        # The approver was shown the 80,000 refund, but the grant names this operation.
        grant_approval(
            connection,
            operation.id,
            approved_by="a@example.com",
            ttl=TTL,
            intent_hash=other.input_fingerprint,
        )
        check = check_approval(connection, operation.id)

    assert check.status is ApprovalStatus.INTENT_CHANGED
    # Named by the keyed short fingerprint, the one form a person reads anywhere.
    key = execute_admin(database_url, "SELECT fingerprint_key FROM outbox_deployment")[0][0]
    assert keyed_fingerprint(key, other.input_fingerprint) in check.reason
    assert keyed_fingerprint(key, operation.input_fingerprint) in check.reason
    assert operation.input_fingerprint[:12] not in check.reason


def test_a_grant_for_another_operation_does_not_cover_this_one(
    engine: sa.Engine, registry: Registry
) -> None:
    approved = record(engine, registry)
    # Same intent, new decision: a new operation id needs its own approval.
    same_intent = record(engine, registry)
    assert same_intent.input_fingerprint == approved.input_fingerprint
    with engine.begin() as connection:
        grant_approval(connection, approved.id, approved_by="a@example.com", ttl=TTL)
        check = check_approval(connection, same_intent.id)

    assert check.status is ApprovalStatus.MISSING
    assert check.approval is None


def test_the_latest_decision_wins_and_a_denial_refuses(
    engine: sa.Engine, registry: Registry
) -> None:
    operation = record(engine, registry)
    with engine.begin() as connection:
        grant_approval(connection, operation.id, approved_by="a@example.com", ttl=TTL)
        denial = Store(connection).run(
            outbox_store.decide_approval(
                operation.id, decision=ApprovalDecision.DENIED, approved_by="b@example.com", ttl=TTL
            )
        )
        check = check_approval(connection, operation.id)

    assert check.status is ApprovalStatus.DENIED
    assert check.approval is not None
    assert check.approval.id == denial.id


def test_approvals_for_an_unknown_operation_are_refused(
    engine: sa.Engine, registry: Registry
) -> None:
    missing = uuid4()
    with engine.begin() as connection:
        with pytest.raises(OperationNotFound):
            grant_approval(connection, missing, approved_by="a@example.com", ttl=TTL)
        with pytest.raises(OperationNotFound):
            check_approval(connection, missing)


def test_a_grant_needs_a_name_and_a_lifetime(engine: sa.Engine, registry: Registry) -> None:
    operation = record(engine, registry)
    with engine.begin() as connection:
        with pytest.raises(ValueError, match="approved_by"):
            grant_approval(connection, operation.id, approved_by="  ", ttl=TTL)
        with pytest.raises(ValueError, match="time to live"):
            grant_approval(connection, operation.id, approved_by="a@example.com", ttl=timedelta(0))
        assert check_approval(connection, operation.id).status is ApprovalStatus.MISSING


async def test_async_grant_and_check(
    async_engine: AsyncEngine, engine: sa.Engine, registry: Registry
) -> None:
    operation = record(engine, registry)
    async with async_engine.begin() as connection:
        grant = await grant_approval_async(
            connection, operation.id, approved_by="a@example.com", ttl=TTL
        )
    async with async_engine.connect() as connection:
        check = await check_approval_async(connection, operation.id)

    assert check.status is ApprovalStatus.VALID
    assert check.approval == grant.model_copy(update={"approved_by": None})


def test_the_consumer_the_operator_and_the_agent_read_one_approval_status(
    engine: sa.Engine, registry: Registry
) -> None:
    """The same approval rows, read through the consumer's check, the operator's
    listing and the agent's outcome, give one status each: a front end that disagreed
    would tell a person or an agent something other than what the consumer does."""
    operations = {status: record(engine, registry) for status in ApprovalStatus}
    valid, expired, denied, changed = (
        operations[ApprovalStatus.VALID],
        operations[ApprovalStatus.EXPIRED],
        operations[ApprovalStatus.DENIED],
        operations[ApprovalStatus.INTENT_CHANGED],
    )
    other_intent = record(engine, registry, amount_cents=80_000).input_fingerprint
    with engine.begin() as connection:
        grant_approval(connection, valid.id, approved_by="a@example.com", ttl=TTL)
        grant_approval(
            connection, expired.id, approved_by="a@example.com", ttl=timedelta(microseconds=1)
        )
        grant_approval(connection, denied.id, approved_by="a@example.com", ttl=TTL)
        Store(connection).run(
            outbox_store.decide_approval(
                denied.id, decision=ApprovalDecision.DENIED, approved_by="b@example.com", ttl=TTL
            )
        )
        grant_approval(
            connection, changed.id, approved_by="a@example.com", ttl=TTL, intent_hash=other_intent
        )
    # A later transaction's clock is past the grant that lived one microsecond.
    with engine.begin() as connection:
        consumer = {s: check_approval(connection, op.id).status for s, op in operations.items()}
        agent = {s: get_outcome(connection, op.id) for s, op in operations.items()}
        listed = Store(connection).run(outbox_store.pending_approvals())
    operator = {
        s: pending.check.status
        for pending in listed
        for s, op in operations.items()
        if pending.operation.id == op.id
    }

    assert consumer == {status: status for status in ApprovalStatus}
    assert {s: outcome.approval for s, outcome in agent.items()} == consumer
    assert {
        s for s, outcome in agent.items() if outcome.status is OutcomeStatus.AWAITING_APPROVAL
    } == set(ApprovalStatus) - {ApprovalStatus.VALID}
    assert operator == {s: s for s in ApprovalStatus if s is not ApprovalStatus.VALID}
    decided_by = {p.operation.id: p.decided_by for p in listed}
    assert (decided_by[denied.id], decided_by[operations[ApprovalStatus.MISSING].id]) == (
        "b@example.com",
        None,
    )
