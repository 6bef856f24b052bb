"""Where a decision stands, as the agent that made it reads it: an :class:`Outcome`.

The operation's state folds into the five answers an agent can act on
(:class:`OutcomeStatus`): done, definitively not done, still running (call again later),
waiting for a person's approval, or with a person who checks the evidence.
:func:`get_outcome` reads it once; :mod:`outbox.awaiting` waits for it.

Not to be confused with :mod:`outbox.outcomes`, what a tool reports after an attempt,
or ``consumer.policy.AttemptOutcome``, what the consumer makes of that report.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal
from uuid import UUID

from outbox import store
from outbox.errors import OperationNotFound
from outbox.models import (
    ApprovalStatus,
    Operation,
    RecordedDecision,
    _Record,
    approval_status,
    display_operation_id,
)
from outbox.states import OperationState
from outbox.store import AsyncConnection, AsyncStore, Plan, Row, Store, SyncConnection

Until = Literal["final", "attention"]


class OutcomeStatus(StrEnum):
    """What an agent can do with a decision, now."""

    COMMITTED = "committed"
    """Final: the provider confirmed the effect."""
    REJECTED = "rejected"
    """Final: the effect did not and will not happen. Retrying the same key changes
    nothing; a changed request is a new decision."""
    PENDING = "pending"
    """The runtime is on it (prepared, in flight, or an unknown outcome under
    reconciliation): ask again later with the same decision key."""
    AWAITING_APPROVAL = "awaiting_approval"
    """The contract asks for a person's approval and there is no valid grant yet."""
    ESCALATED = "escalated"
    """The outcome is with a person, who decides with the evidence."""


FINAL_STATUSES = frozenset({OutcomeStatus.COMMITTED, OutcomeStatus.REJECTED})
ATTENTION_STATUSES = FINAL_STATUSES | {OutcomeStatus.AWAITING_APPROVAL, OutcomeStatus.ESCALATED}


def statuses_until(until: Until) -> frozenset[OutcomeStatus]:
    if until == "final":
        return FINAL_STATUSES
    if until == "attention":
        return ATTENTION_STATUSES
    raise ValueError(f"until must be 'final' or 'attention', not {until!r}")


class Outcome(_Record):
    """Where one decision stands, as an agent (or an MCP client) reads it.

    It carries no tool input and no provider message: ``reason`` is a code from a closed
    alphabet (the error class, the escalation or approval reason), safe to show to a
    model and to log.
    """

    operation_id: UUID
    display_id: str
    run_id: str
    decision_key: str | None
    tool: str
    tool_version: int
    status: OutcomeStatus
    state: OperationState
    """The operation's own state, for operators; ``status`` is what an agent acts on."""
    final: bool
    needs_person: bool
    provider_reference: str | None
    result: dict[str, Any] | None
    """The tool's result, once committed."""
    reason: str | None
    approval: ApprovalStatus | None
    """For an operation whose contract asks for approval and that is not yet executed."""
    attempts: int
    updated_at: datetime


def _approval_status(row: dict[str, Any]) -> ApprovalStatus:
    return approval_status(
        row["approval_decision"],
        row["approval_expires_at"],
        row["approval_intent_hash"],
        fingerprint=row["input_fingerprint"],
        now=row["checked_at"],
    )


_STATUS_OF_STATE = {
    OperationState.COMMITTED: OutcomeStatus.COMMITTED,
    OperationState.REJECTED: OutcomeStatus.REJECTED,
    OperationState.ESCALATED: OutcomeStatus.ESCALATED,
}


def status_of_row(row: dict[str, Any]) -> OutcomeStatus:
    """The status alone: cheap enough to run on every row of every wake-up (building
    the :class:`Outcome` is left for the waiters it answers)."""
    state = OperationState(row["state"])
    settled = _STATUS_OF_STATE.get(state)
    if settled is not None:
        return settled
    if (
        state is OperationState.PREPARED
        and row["requires_approval"]
        and _approval_status(row) is not ApprovalStatus.VALID
    ):
        return OutcomeStatus.AWAITING_APPROVAL
    return OutcomeStatus.PENDING


def outcome_from_row(row: dict[str, Any]) -> Outcome:
    """Fold one ``operation_outcomes`` row into the status an agent acts on."""
    state = OperationState(row["state"])
    status = status_of_row(row)
    approval = (
        _approval_status(row)
        if row["requires_approval"] and state is OperationState.PREPARED
        else None
    )
    reason: str | None = row["last_error_class"]
    if status is OutcomeStatus.COMMITTED:
        reason = None
    elif status is OutcomeStatus.AWAITING_APPROVAL:
        reason = f"approval_{approval}"
    operation_id: UUID = row["id"]
    return Outcome(
        operation_id=operation_id,
        display_id=display_operation_id(operation_id),
        run_id=row["run_id"],
        decision_key=row["decision_key"],
        tool=row["tool_name"],
        tool_version=row["tool_version"],
        status=status,
        state=state,
        final=status in FINAL_STATUSES,
        needs_person=status in (OutcomeStatus.AWAITING_APPROVAL, OutcomeStatus.ESCALATED),
        provider_reference=row["provider_reference"],
        result=row["result"] if state is OperationState.COMMITTED else None,
        reason=reason,
        approval=approval,
        attempts=row["attempts"],
        updated_at=row["updated_at"],
    )


def get_outcome(connection: SyncConnection, operation_id: UUID) -> Outcome:
    """One read of where ``operation_id`` stands, from history once it moved there.
    Raises :class:`OperationNotFound`."""
    rows = Store(connection, require_transaction=False).run(outcome_rows(operation_id))
    return single_outcome(rows, operation_id)


async def get_outcome_async(connection: AsyncConnection, operation_id: UUID) -> Outcome:
    """The async twin of :func:`get_outcome`."""
    runner = await AsyncStore.on(connection, require_transaction=False)
    return single_outcome(await runner.run(outcome_rows(operation_id)), operation_id)


def outcome_rows(operation_id: UUID, key: tuple[str, str] | None = None) -> Plan[list[Row]]:
    """The operation's outcome row: from the hot tables, or (only when they no longer
    hold it) as history keeps it; ``key`` is its ``(run_id, decision_key)`` if known."""
    rows = yield from store.operation_outcomes([operation_id])
    if rows:
        return rows
    return (yield from store.archived_outcomes({operation_id: key}))


def decision_key_of(operation: object) -> tuple[str, str] | None:
    """The ``(run_id, decision_key)`` of what an agent waits on, when it carries one: an
    archived operation's outcome is then found by its key alone."""
    if isinstance(operation, RecordedDecision):
        operation = operation.operation
    if isinstance(operation, Operation | Outcome) and operation.decision_key is not None:
        return operation.run_id, operation.decision_key
    return None


def single_outcome(rows: list[dict[str, Any]], operation_id: UUID) -> Outcome:
    if not rows:
        raise not_visible(operation_id)
    if rows[0]["state"] is None:
        raise archived_without_key(operation_id)
    return outcome_from_row(rows[0])


def archived_without_key(operation_id: UUID) -> OperationNotFound:
    shown = display_operation_id(operation_id)
    return OperationNotFound(
        f"{shown} settled and moved to history, and was recorded without a decision key: "
        f"its outcome is kept only where operators read it (outbox ops show {shown})"
    )


def not_visible(operation_id: UUID) -> OperationNotFound:
    return OperationNotFound(
        f"no operation {display_operation_id(operation_id)} is visible: if you just "
        "recorded it, await its outcome after your transaction commits (an uncommitted "
        "decision exists for no other session)"
    )
