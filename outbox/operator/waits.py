"""Why an operation that has not ended waits, and until when, in the words a person reads
on the console's operation page: a prepared operation waiting for a person's approval is
told apart from one no consumer has claimed, and an unknown outcome says whether it
waits for a lookup or for a callback, and until when.

The rule for a prepared operation is the one the overview counts by
(:func:`outbox.store.prepared_waits`): approval, provider, dispatcher, backoff, consumer,
the first that applies."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from outbox.contracts import OnUnknown, SideEffect, ToolContract
from outbox.models import ApprovalCheck, Operation
from outbox.operator.render import age_text
from outbox.states import OperationState
from outbox.store import PreparedWait

S = OperationState


@dataclass(frozen=True)
class Wait:
    kind: str
    """``approval``, ``provider``, ``unpublished``, ``scheduled``, ``ready`` (the
    :class:`PreparedWait` values), ``attempt``, ``lease_expired``, ``lookup``,
    ``callback`` or ``reconciler``."""
    what: str
    """What it waits for, a sentence without the time."""
    until: datetime | None = None
    """When the wait ends or the runtime acts next; None when nothing is scheduled (a
    person, a consumer)."""


def prepared_wait(
    operation: Operation, approval: ApprovalCheck | None, *, unpublished: bool, now: datetime
) -> PreparedWait:
    """What a prepared operation waits for, as the overview counts it."""
    if operation.requires_approval and approval is not None and not approval.is_valid:
        return PreparedWait.APPROVAL
    if operation.waiting_since is not None:
        return PreparedWait.PROVIDER
    if unpublished:
        return PreparedWait.UNPUBLISHED
    if operation.next_attempt_at > now:
        return PreparedWait.SCHEDULED
    return PreparedWait.READY


def operation_wait(
    operation: Operation,
    *,
    approval: ApprovalCheck | None,
    unpublished: bool,
    contract: ToolContract[Any] | None,
    now: datetime,
) -> Wait | None:
    """Why ``operation`` waits; None once it has ended, or when escalated (the page's
    header says why a person has it)."""
    if operation.state is S.PREPARED:
        return _prepared(operation, approval, unpublished=unpublished, now=now)
    if operation.state is S.IN_FLIGHT:
        return _in_flight(operation, now)
    if operation.state is S.OUTCOME_UNKNOWN:
        return _unknown(operation, contract, now)
    return None


def _prepared(
    operation: Operation, approval: ApprovalCheck | None, *, unpublished: bool, now: datetime
) -> Wait:
    kind = prepared_wait(operation, approval, unpublished=unpublished, now=now)
    if kind is PreparedWait.APPROVAL:
        assert approval is not None
        return Wait(
            kind,
            f"a person's approval ({approval.status}: {approval.reason}); a consumer does "
            "not execute it without one",
        )
    if kind is PreparedWait.PROVIDER:
        return Wait(
            kind,
            "its provider, which could not be reached; the next try spends no attempt",
            operation.next_attempt_at,
        )
    if kind is PreparedWait.UNPUBLISHED:
        return Wait(kind, "the dispatcher: its message is not published to the broker yet")
    if kind is PreparedWait.SCHEDULED:
        return Wait(
            kind,
            f"the time of its next attempt (attempt {operation.attempts + 1}), after a backoff",
            operation.next_attempt_at,
        )
    return Wait(
        kind,
        "a consumer to claim it: it is due and published, and no consumer has claimed it "
        f"(due for {age_text((now - operation.next_attempt_at).total_seconds())})",
    )


def _in_flight(operation: Operation, now: datetime) -> Wait:
    expires = operation.lease_expires_at
    if expires is not None and expires <= now:
        return Wait(
            "lease_expired",
            "the reconciler: the consumer's lease has expired, so it takes the attempt as an "
            "unknown outcome",
            expires,
        )
    return Wait(
        "attempt",
        f"the provider's answer to attempt {operation.attempts}; a consumer holds it until "
        "its lease ends",
        expires,
    )


def _unknown(operation: Operation, contract: ToolContract[Any] | None, now: datetime) -> Wait:
    due = operation.next_attempt_at
    if operation.lease_expires_at is not None and operation.lease_expires_at > now:
        return Wait("lookup", "the answer of a lookup under way", operation.lease_expires_at)
    if operation.waiting_since is not None:
        return Wait(
            "provider",
            "its provider, which could not be reached; the next lookup spends none of the budget",
            due,
        )
    if contract is None:
        return Wait(
            "reconciler",
            "the reconciler's next step: a lookup, the end of a wait for a callback, or a "
            "person (a console started with --tools says which)",
            due,
        )
    if contract.reconcile is not None and contract.on_unknown is OnUnknown.RECONCILE:
        budget = contract.retry.reconcile_max_attempts
        callback = (
            f", or a verified callback from {contract.callbacks.provider.name} before it"
            if contract.callbacks is not None and contract.callbacks.settles_unknown
            else ""
        )
        return Wait(
            "lookup",
            f"its next lookup at the provider (lookup {operation.reconcile_attempts + 1} of "
            f"{budget}; then a person){callback}",
            due,
        )
    if contract.callbacks is not None and contract.callbacks.wait > timedelta(0):
        return Wait(
            "callback",
            f"a verified callback from {contract.callbacks.provider.name}; when none has "
            f"come, {_after_callback_wait(contract)}",
            due,
        )
    return Wait("reconciler", f"the reconciler's next step: {_after_callback_wait(contract)}", due)


def _after_callback_wait(contract: ToolContract[Any]) -> str:
    if contract.on_unknown is OnUnknown.ESCALATE:
        return "a person"
    if contract.side_effect in (SideEffect.READ_ONLY, SideEffect.IDEMPOTENT_WRITE):
        return "another attempt, within the retry budget"
    if contract.side_effect is SideEffect.DEDUPLICATED_WRITE and contract.dedupe_window:
        return "another attempt with the same key while inside the dedupe window, else a person"
    return "a person"
