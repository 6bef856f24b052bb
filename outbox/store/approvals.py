"""Approvals: a person's grant or denial bound to an operation's intent, and the rule
that says whether an operation's effect may be attempted under one right now.

The consumer applies :func:`check_approval` before it executes; ``outbox approvals``
lists with the same rule (:func:`outbox.store.operator.pending_approvals`).
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID, uuid4

from outbox import lifecycle
from outbox.errors import OperationNotFound
from outbox.models import Approval, ApprovalCheck, ApprovalDecision, ApprovalStatus
from outbox.states import EventName
from outbox.store.operations import get_operation
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
    """Is there a grant this operation's effect may be attempted under, right now?"""
    rows = yield Step("latest_approval", {"operation_id": operation_id})
    if not rows:
        raise OperationNotFound(f"no operation with id {operation_id}")
    row = rows[0]
    if row["id"] is None:
        return ApprovalCheck(
            status=ApprovalStatus.MISSING, reason="no approval was granted for this operation"
        )
    approval = Approval.model_validate(row)
    if approval.decision is ApprovalDecision.DENIED:
        status, reason = ApprovalStatus.DENIED, f"denied by {approval.approved_by}"
    elif approval.expires_at <= row["checked_at"]:
        status, reason = ApprovalStatus.EXPIRED, f"the grant expired at {approval.expires_at}"
    elif approval.intent_hash != row["operation_fingerprint"]:
        status, reason = (
            ApprovalStatus.INTENT_CHANGED,
            f"the grant approved intent {approval.intent_hash[:12]}, the operation's intent is "
            f"{row['operation_fingerprint'][:12]}",
        )
    else:
        status, reason = ApprovalStatus.VALID, f"granted by {approval.approved_by}"
    return ApprovalCheck(status=status, reason=reason, approval=approval)
