"""Approvals: a person's grant or denial bound to an operation's intent, and the rule
that says whether an operation's effect may be attempted under one right now.

The rule itself is :func:`outbox.models.approval_status`: the consumer applies it
through :func:`check_approval` before it executes, ``outbox approvals`` lists with it
(:func:`outbox.store.operator.pending_approvals`, through :func:`approval_check`), and
an agent's :class:`outbox.Outcome` reads it (``outbox/awaiting.py``).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID, uuid4

from outbox import lifecycle
from outbox.bounds import MAX_APPROVAL_TTL
from outbox.errors import OperationNotFound
from outbox.fingerprint_key import keyed_fingerprint
from outbox.models import (
    Approval,
    ApprovalCheck,
    ApprovalDecision,
    ApprovalStatus,
    approval_status,
)
from outbox.states import EventName
from outbox.store.operations import fingerprint_key, get_operation
from outbox.store.runner import Plan, Step


def decide_approval(
    operation_id: UUID,
    *,
    decision: ApprovalDecision,
    approved_by: str,
    ttl: timedelta,
    intent_hash: str | None = None,
) -> Plan[Approval]:
    """Record a grant or denial bound to the operation's intent.

    ``intent_hash`` is the fingerprint the person was shown; None binds the grant to
    the operation's own fingerprint. A grant for a prepared operation also queues a
    fresh outbox row, in the same statement.
    """
    if not approved_by.strip():
        raise ValueError("approved_by must name the person who decided")
    if ttl <= timedelta(0):
        raise ValueError("an approval needs a positive time to live")
    if ttl > MAX_APPROVAL_TTL:
        raise ValueError(
            f"an approval lasts at most {MAX_APPROVAL_TTL.days} days (the database refuses "
            "a later expiry); grant again when it runs out"
        )
    rows = yield Step(
        "insert_approval",
        {
            "id": uuid4(),
            "operation_id": operation_id,
            "intent_hash": intent_hash,
            "decision": str(decision),
            "approved_by": approved_by,
            "ttl": ttl,
        },
    )
    if not rows:
        raise OperationNotFound(f"no operation with id {operation_id}")
    approval = Approval.model_validate(rows[0])
    operation = yield from get_operation(operation_id)
    name = (
        EventName.APPROVAL_GRANTED
        if decision is ApprovalDecision.GRANTED
        else EventName.APPROVAL_DENIED
    )
    # Who decided is in the approvals row; a log line carries ids, never people's names.
    lifecycle.emit(name, operation, {"approval_id": str(approval.id)})
    return approval


def check_approval(operation_id: UUID) -> Plan[ApprovalCheck]:
    """Is there a grant this operation's effect may be attempted under, right now?

    The answer names intents by their keyed short fingerprint, never who decided: the
    agent role, which asks this, may not read people's names."""
    key = yield from fingerprint_key()
    rows = yield Step("latest_approval", {"operation_id": operation_id})
    if not rows:
        raise OperationNotFound(f"no operation with id {operation_id}")
    row = rows[0]
    latest = None if row["id"] is None else Approval.model_validate(row)
    return approval_check(
        latest, fingerprint=row["operation_fingerprint"], now=row["checked_at"], key=key
    )


def approval_check(
    latest: Approval | None, *, fingerprint: str, now: datetime, key: str
) -> ApprovalCheck:
    """:func:`outbox.models.approval_status` of an operation whose intent is
    ``fingerprint`` under its ``latest`` approval decision, with the reason a person
    reads; ``now`` and ``fingerprint`` as the database read them with the decision."""
    if latest is None:
        return ApprovalCheck(
            status=ApprovalStatus.MISSING, reason="no approval was granted for this operation"
        )
    status = approval_status(
        latest.decision, latest.expires_at, latest.intent_hash, fingerprint=fingerprint, now=now
    )
    if status is ApprovalStatus.DENIED:
        reason = "a person denied it"
    elif status is ApprovalStatus.EXPIRED:
        reason = f"the grant expired at {latest.expires_at}"
    elif status is ApprovalStatus.INTENT_CHANGED:
        reason = (
            f"the grant approved intent {keyed_fingerprint(key, latest.intent_hash)}, the "
            f"operation's intent is {keyed_fingerprint(key, fingerprint)}"
        )
    else:
        reason = f"granted until {latest.expires_at}"
    return ApprovalCheck(status=status, reason=reason, approval=latest)
