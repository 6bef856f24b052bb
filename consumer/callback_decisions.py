"""What a verified provider callback does to its operation (docs/design.md section 5,
"Callbacks"), as pure functions beside :mod:`consumer.policy`'s table of attempts and
lookups: a callback is evidence, never a command. consumer/callbacks.py writes what
they decide, with the operation's row locked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from consumer.policy import EscalationReason, Transition
from outbox.callback_policy import CallbackStatus
from outbox.contracts import SideEffect, ToolContract
from outbox.models import Callback, CallbackOutcome, Operation
from outbox.states import EventName, OperationState

S = OperationState


@dataclass(frozen=True)
class CallbackDecision:
    """What a verified provider callback comes to (docs/design.md section 5, "Callbacks"):
    its outcome; ``contradiction``, the reason of an ``operation.contradicted`` event to
    append first; and ``move``, a transition to write after it, under the operation's
    lock."""

    outcome: CallbackOutcome
    move: Transition | None = None
    contradiction: str | None = None


_EVIDENCE = CallbackDecision(CallbackOutcome.EVIDENCE)
_CONFIRMED = CallbackDecision(CallbackOutcome.CONFIRMED)


def after_callback(
    operation: Operation,
    contract: ToolContract[Any],
    callback: Callback,
    *,
    success_reported: bool,
) -> CallbackDecision | None:
    """What ``callback`` does to ``operation``, read with its row locked; None while the
    operation is in flight (the attempt's own record comes first, fenced by its token;
    the callback is applied after it). ``success_reported``: another callback of the
    contract's provider reported this operation's effect done.

    A callback is evidence, never a command: it settles only what the contract lets its
    provider settle, moves nothing backwards, and one that disagrees with the recorded
    ending is a contradiction for a person, never a quiet overwrite.
    """
    if operation.state is S.IN_FLIGHT:
        return None
    policy = contract.callbacks
    if policy is None or policy.provider.name != callback.provider:
        # Another provider's word about this effect: shown to whoever looks, no more.
        return _EVIDENCE
    if callback.status is CallbackStatus.PENDING or operation.state is S.ESCALATED:
        return _EVIDENCE
    if callback.status is CallbackStatus.COMMITTED:
        return _after_success(operation, contract, callback, settles=policy.settles_unknown)
    return _after_failure(
        operation, callback, definitive=policy.failure_definitive, success=success_reported
    )


def _after_success(
    operation: Operation, contract: ToolContract[Any], callback: Callback, *, settles: bool
) -> CallbackDecision:
    state = operation.state
    if state is S.OUTCOME_UNKNOWN:
        if not settles:
            return _EVIDENCE
        return CallbackDecision(
            CallbackOutcome.SETTLED,
            Transition(
                S.OUTCOME_UNKNOWN,
                S.COMMITTED,
                {"result": "committed", "method": "callback", "callback": callback.id},
                event=EventName.RECONCILED,
                provider_reference=callback.provider_reference,
            ),
        )
    if state is S.COMMITTED:
        recorded, reported = operation.provider_reference, callback.provider_reference
        if recorded is None or reported is None or recorded == reported:
            return _CONFIRMED
        return CallbackDecision(CallbackOutcome.CONTRADICTED, contradiction="reference_differs")
    if state is S.PREPARED:
        if operation.effect_possible and contract.side_effect in (
            SideEffect.IDEMPOTENT_WRITE,
            SideEffect.DEDUPLICATED_WRITE,
        ):
            # Sent back after an unknown outcome because its class lets it repeat: the
            # retry meets the same effect (same input, or the same key inside its
            # window), and the callback says what it will find.
            return _EVIDENCE
        # An effect nobody accounts for (never attempted, never sent, proven absent, or a
        # person said "not committed"), about to be attempted again: a second one.
        return _contradicted(operation, callback, "success_for_prepared")
    return CallbackDecision(CallbackOutcome.CONTRADICTED, contradiction="success_for_rejected")


def _after_failure(
    operation: Operation, callback: Callback, *, definitive: bool, success: bool
) -> CallbackDecision:
    state = operation.state
    if state is S.COMMITTED:
        return CallbackDecision(CallbackOutcome.CONTRADICTED, contradiction="failure_after_success")
    if state is S.REJECTED:
        return _CONFIRMED
    if state is S.OUTCOME_UNKNOWN and definitive:
        if success:
            return _contradicted(operation, callback, "failure_and_success")
        # The lookup path's NotFound: proof of absence, the only road back to an attempt.
        return CallbackDecision(
            CallbackOutcome.RETRY,
            Transition(
                S.OUTCOME_UNKNOWN,
                S.PREPARED,
                {"result": "not_found", "method": "callback", "callback": callback.id},
                event=EventName.RECONCILED,
                effect_disproved=True,
            ),
        )
    return _EVIDENCE


def _contradicted(operation: Operation, callback: Callback, reason: str) -> CallbackDecision:
    """A contradiction that must stop the operation where it is: to a person."""
    return CallbackDecision(
        CallbackOutcome.CONTRADICTED,
        Transition(
            operation.state,
            S.ESCALATED,
            {
                "reason": str(EscalationReason.CONTRADICTED),
                "callback": callback.id,
                "attempts": operation.attempts,
            },
            error_class=str(EscalationReason.CONTRADICTED),
        ),
        contradiction=reason,
    )


def contradicted_lookup(operation: Operation, success: Callback) -> CallbackDecision:
    """A lookup's NotFound for an unknown outcome whose provider reported it done: not a
    retry (it would be a second effect) but a person, with both on record."""
    return _contradicted(operation, success, "not_found_and_success")
