"""Records that cross a boundary (database rows handed to callers, CLI JSON output)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any
from uuid import UUID

from pydantic import BaseModel, BeforeValidator, ConfigDict

from outbox.bounds import object_or_unreadable
from outbox.callback_policy import CallbackStatus
from outbox.contracts import SideEffect
from outbox.fingerprint import sanitized
from outbox.states import OperationState

OPERATION_ID_PREFIX = "op_"

# A stored JSON object, as read back: a value of another kind (an array, a string) that
# a row may hold from before the database's bounds reads as the unreadable marker.
StoredObject = Annotated[dict[str, Any], BeforeValidator(object_or_unreadable)]


def display_operation_id(operation_id: UUID) -> str:
    """How an operation id appears in logs and the CLI: ``op_<uuid>``."""
    return f"{OPERATION_ID_PREFIX}{operation_id}"


def parse_operation_id(text: str) -> UUID:
    """Accepts ``op_<uuid>`` or a bare UUID."""
    return UUID(text.removeprefix(OPERATION_ID_PREFIX))


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class Operation(_Record):
    """One agent decision and where its effect stands."""

    id: UUID
    run_id: str
    decision_key: str | None
    tool_name: str
    tool_version: int
    side_effect: SideEffect
    input: StoredObject
    input_fingerprint: str
    requires_approval: bool
    state: OperationState
    attempts: int
    reconcile_attempts: int
    lease_token: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    next_attempt_at: datetime
    first_attempt_at: datetime | None
    provider_reference: str | None
    result: StoredObject | None
    last_error_class: str | None
    effect_possible: bool
    """An attempt's outcome was unknown and no lookup has proved the effect absent since:
    the effect may have happened, so no later failure can end the operation rejected."""
    created_at: datetime
    updated_at: datetime
    waiting_since: datetime | None = None
    """Since when it has been waiting for its provider (calls and lookups that could not
    reach it); None once the provider answered. Read where it is selected."""

    @property
    def display_id(self) -> str:
        return display_operation_id(self.id)

    @property
    def sanitized_fingerprint(self) -> str:
        return sanitized(self.input_fingerprint)


class RecordedDecision(_Record):
    """What ``record_decision`` returns: the operation, and whether this call created it."""

    operation: Operation
    created: bool


class OperationEvent(_Record):
    id: int
    operation_id: UUID
    name: str
    attributes: StoredObject
    created_at: datetime


class OutboxRow(_Record):
    id: int
    operation_id: UUID
    routing_key: str
    headers: StoredObject
    created_at: datetime
    available_at: datetime
    published_at: datetime | None
    publish_attempts: int
    last_error: str | None


class ApprovalDecision(StrEnum):
    GRANTED = "granted"
    DENIED = "denied"


class Approval(_Record):
    id: UUID
    operation_id: UUID
    intent_hash: str
    decision: ApprovalDecision
    approved_by: str | None = None
    """Who decided: read only where a person's name may be (the operator's commands and
    console); None in what the agent and the consumer read, which never need it."""
    expires_at: datetime
    created_at: datetime


class ApprovalStatus(StrEnum):
    VALID = "valid"
    MISSING = "missing"
    EXPIRED = "expired"
    INTENT_CHANGED = "intent_changed"
    DENIED = "denied"


def approval_status(
    decision: str | None,
    expires_at: datetime | None,
    intent_hash: str | None,
    *,
    fingerprint: str,
    now: datetime,
) -> ApprovalStatus:
    """May an operation whose intent is ``fingerprint`` be executed at ``now`` under its
    latest approval decision (``decision`` None: there is none; an
    :class:`ApprovalDecision` or its stored text)?

    The one rule: the consumer applies it before it executes (``check_approval``), the
    operator lists by it (``pending_approvals``) and the agent reads it in an
    :class:`outbox.Outcome`, so none of them can be told something the others are not.
    ``now`` is the database's clock, which the expiry was written on.
    """
    if decision is None or expires_at is None:
        return ApprovalStatus.MISSING
    if decision == ApprovalDecision.DENIED:
        return ApprovalStatus.DENIED
    if expires_at <= now:
        return ApprovalStatus.EXPIRED
    if intent_hash != fingerprint:
        return ApprovalStatus.INTENT_CHANGED
    return ApprovalStatus.VALID


class ApprovalCheck(_Record):
    status: ApprovalStatus
    reason: str
    approval: Approval | None = None

    @property
    def is_valid(self) -> bool:
        return self.status is ApprovalStatus.VALID


class CallbackOutcome(StrEnum):
    """What the consumer did with a callback (docs/design.md section 5, "Callbacks"); a
    metric label value."""

    SETTLED = "settled"
    """An unknown outcome committed by it."""
    RETRY = "retry"
    """An unknown outcome proven absent by it: back to prepared."""
    CONFIRMED = "confirmed"
    """It agrees with the recorded ending."""
    EVIDENCE = "evidence"
    """Kept for a person; it moved nothing."""
    CONTRADICTED = "contradicted"
    """It disagrees with the recorded ending: operation.contradicted, a metric, an alert."""
    UNMATCHED = "unmatched"
    """It names no operation of this database."""


class Callback(_Record):
    """One verified provider callback, as the inbox keeps it: never its body."""

    id: int
    provider: str
    event_id: str
    status: CallbackStatus
    named_operation_id: UUID | None
    operation_id: UUID | None
    provider_reference: str | None
    payload_digest: str
    received_at: datetime
    outcome: CallbackOutcome | None
    applied_at: datetime | None
