"""What may follow an outcome: the consumer's decisions as pure functions.

docs/design.md section 5 says, per side-effect class, what may happen after an attempt and
after a lookup. This module turns that table into values: a :class:`Transition` to
write under the fencing token the decision was made with, an :class:`Escalation` to a
person, a :class:`Deferral` of the next lookup, or :class:`LookUp`. It reads nothing
but its arguments, so every row of the table is testable in milliseconds; the worker
and the reconciler only write the decisions through the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from outbox import replay
from outbox.breaker import ProviderHealth, could_not_reach
from outbox.contracts import OnUnknown, SideEffect, ToolContract
from outbox.models import Operation
from outbox.outcomes import EffectResult, Found, NotFound, Reconciliation
from outbox.states import EventName, OperationState, Waiting
from outbox.text import Scalar

S = OperationState

# The code of an attempt a worker gave up before calling: its lease ran out first.
LEASE_LOST_BEFORE_CALL = "lease_lost_before_call"


class AttemptOutcome(StrEnum):
    """What one call of a tool's ``execute`` came to (also a metric label value)."""

    COMMITTED = "committed"
    """The provider confirmed the effect."""
    REJECTED = "rejected"
    """The provider refused for good; the effect did not happen."""
    NOT_SENT = "not_sent"
    """The request provably never reached the provider, or was never made."""
    OUTCOME_UNKNOWN = "outcome_unknown"
    """The effect may have happened."""
    UNAVAILABLE = "unavailable"
    """The provider could not take the request now (unreachable, rate limited, or still
    working on the same key): nothing happened, and the operation waits for it without
    spending the attempt."""


class Unavailability(StrEnum):
    """Why the provider could not take an attempt (an event attribute)."""

    UNREACHABLE = "unreachable"
    """It could not be reached or could not serve: counts toward its breaker."""
    RATE_LIMITED = "rate_limited"
    """It asked us to slow down: its Retry-After holds every consumer back."""
    IN_PROGRESS = "in_progress"
    """It is still working on this key: only this operation waits."""
    HELD = "held"
    """Never called: its breaker opened, or a Retry-After arrived, after the claim."""


@dataclass(frozen=True)
class Attempt:
    outcome: AttemptOutcome
    code: str
    effect: EffectResult | None = None
    """What the provider confirmed; set exactly when the outcome is committed."""
    retry_after: timedelta | None = None
    """The provider's Retry-After, when it gave one."""
    unavailability: Unavailability | None = None
    """Set exactly when the outcome is unavailable."""


@dataclass(frozen=True)
class ProviderWait:
    """How an operation's provider holds it back."""

    provider: str
    delay: timedelta
    """Until it is tried again (sooner if the provider comes back)."""
    waited: timedelta
    """How long it has waited so far, this wait included up to now."""
    outage: ProviderHealth | None = None
    """The provider's open breaker, when that is what holds it back."""


class EscalationReason(StrEnum):
    """Why an unknown outcome goes to a person (a metric label and an event attribute)."""

    BY_CONTRACT = "escalate_by_contract"
    RECONCILE_BUDGET_EXHAUSTED = "reconcile_budget_exhausted"
    RETRY_BUDGET_EXHAUSTED = "retry_budget_exhausted"
    DEDUPE_WINDOW_PASSED = "dedupe_window_passed"
    NO_RECONCILE = "no_reconcile"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    """The operation waited for its provider longer than the contract's
    ``outage_tolerance``: time ran out, not attempts or lookups."""
    EFFECT_POSSIBLE = "effect_possible"
    """An attempt failed for good (refused, or out of attempts that never left) after an
    earlier attempt's outcome was unknown, and no lookup can say whether that one landed."""
    CONTRADICTED = "contradicted"
    """The provider's callbacks disagree with the recorded state, or with each other, or
    with a lookup: a success for an operation about to be attempted again, a failure
    after a success, a lookup's NotFound after a success."""


@dataclass(frozen=True)
class Transition:
    """Move the operation ``source -> target``, but only if it is still in ``source``
    under the fencing token the decision was made with."""

    source: OperationState
    target: OperationState
    attributes: Mapping[str, Scalar]
    """The lifecycle event's attributes, besides the ones the store adds."""
    event: EventName | None = None
    """None: the store's event for ``target``."""
    error_class: str | None = None
    delay: timedelta | None = None
    """How long a move back to ``prepared`` waits before the next attempt."""
    reconcile_attempt: bool = False
    """Whether the move counts a lookup."""
    provider_reference: str | None = None
    result: Mapping[str, Any] | None = None
    effect_disproved: bool = False
    """A lookup proved the effect absent: clear the operation's ``effect_possible``."""
    then: Escalation | None = None
    """Written right after this move, in the same transaction: an escalation that can
    only start from where this move leaves the operation."""
    waiting: Waiting | None = None
    """What the move does to the operation's wait for its provider (the store's default
    when None: ended by a settled or escalated target, kept otherwise)."""
    attempt_refunded: bool = False
    """Give back the attempt the claim counted: the provider could not take it."""


@dataclass(frozen=True)
class Escalation:
    """Hand the operation to a person: ``transition`` moves it to ``escalated`` with the
    evidence gathered so far."""

    reason: EscalationReason
    transition: Transition


@dataclass(frozen=True)
class Deferral:
    """An inconclusive lookup: count it, and look again after ``delay``."""

    code: str
    delay: timedelta


@dataclass(frozen=True)
class LookUp:
    """Ask the provider (the tool's ``reconcile``) before anything else may happen."""


def after_attempt(
    operation: Operation,
    contract: ToolContract[Any],
    attempt: Attempt,
    wait: ProviderWait | None = None,
) -> Transition:
    """Where an attempt leaves the in-flight ``operation`` it was made for.

    ``rejected`` promises the effect did not and will not happen, so it is never the end
    of an operation whose effect may have happened (``operation.effect_possible``: an
    earlier attempt's outcome was unknown and no lookup has proved it absent since):

    - ``NotSent`` with no attempt left proves only that *this* attempt never left, not
      that the earlier one did not land.
    - ``DefinitiveRejection`` of an idempotent (or non-repeatable) write proves nothing
      about the earlier attempt either: such a target judges each request as it comes,
      against state the earlier request may itself have changed ("already closed"). A
      deduplicated write's target, by contrast, answers a replayed key with the outcome
      of the first request carrying it, and the key is only replayed inside the dedupe
      window: its refusal means the first did not land, and ``rejected`` stays true.
    - A read has no effect to be unsure of.

    Such an operation goes to ``outcome_unknown``, which is what it is: with a lookup,
    the reconciler asks the provider at once; without one, the same transaction hands it
    to a person (:attr:`EscalationReason.EFFECT_POSSIBLE`), because nothing else can
    tell whether the effect happened.
    """
    attributes: dict[str, Scalar] = {"attempt": operation.attempts}
    if attempt.outcome is AttemptOutcome.UNAVAILABLE:
        return _wait_after_attempt(operation, contract, attempt, wait)
    if attempt.outcome is AttemptOutcome.COMMITTED:
        assert attempt.effect is not None
        return Transition(
            S.IN_FLIGHT,
            S.COMMITTED,
            attributes,
            provider_reference=attempt.effect.provider_reference,
            result=dict(attempt.effect.result),
        )
    if attempt.outcome is AttemptOutcome.REJECTED:
        if _refusal_may_hide_an_effect(operation, contract):
            return _effect_may_have_happened(operation, contract, attempt, "rejected_after_unknown")
        return Transition(S.IN_FLIGHT, S.REJECTED, attributes, error_class=attempt.code)
    if attempt.outcome is AttemptOutcome.NOT_SENT:
        # Never called: neither the tool's retry budget nor its codes apply.
        if attempt.code == LEASE_LOST_BEFORE_CALL or contract.retry.may_retry(
            operation.attempts, attempt.code
        ):
            return Transition(
                S.IN_FLIGHT,
                S.PREPARED,
                {**attributes, "policy": "retry_not_sent"},
                error_class=attempt.code,
                delay=contract.retry.backoff(operation.attempts),
            )
        if operation.effect_possible and contract.side_effect is not SideEffect.READ_ONLY:
            return _effect_may_have_happened(
                operation, contract, attempt, "retry_budget_exhausted_after_unknown"
            )
        # Every attempt provably never left: the effect did not happen, for good.
        return Transition(
            S.IN_FLIGHT,
            S.REJECTED,
            {**attributes, "policy": "retry_budget_exhausted"},
            error_class=attempt.code,
        )
    # The first lookup waits one backoff step: a provider that is still finishing the
    # request would only answer "in progress". Without a lookup, an unknown outcome the
    # provider will report by callback waits for that callback first.
    delay = contract.retry.initial_backoff
    if contract.reconcile is None and contract.callbacks is not None:
        delay = max(delay, contract.callbacks.wait)
    return Transition(
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        attributes,
        error_class=attempt.code,
        delay=delay,
        # No answer came: the wait for the provider starts here, not at its first lookup.
        waiting=Waiting.START if could_not_reach(attempt.code) else None,
    )


def _wait_after_attempt(
    operation: Operation, contract: ToolContract[Any], attempt: Attempt, wait: ProviderWait | None
) -> Transition:
    """An attempt the provider could not take: back to ``prepared`` with the attempt
    given back, waiting for the provider, or to a person once the wait has outlasted
    the contract's tolerance."""
    if wait is None:
        wait = ProviderWait(
            contract.provider_name, contract.retry.backoff(max(1, operation.attempts)), timedelta(0)
        )
    back = Transition(
        S.IN_FLIGHT,
        S.PREPARED,
        {
            "attempt": operation.attempts,
            "policy": "wait_for_provider",
            "provider": wait.provider,
            "unavailable": str(attempt.unavailability or Unavailability.UNREACHABLE),
        },
        error_class=attempt.code,
        delay=wait.delay,
        waiting=Waiting.START,
        attempt_refunded=True,
    )
    if wait.waited < contract.outage_tolerance:
        return back
    waited = operation.model_copy(
        update={"last_error_class": attempt.code, "attempts": operation.attempts - 1}
    )
    return replace(back, then=provider_unavailable(waited, contract, wait, source=S.PREPARED))


def provider_unavailable(
    operation: Operation,
    contract: ToolContract[Any],
    wait: ProviderWait,
    *,
    source: OperationState,
) -> Escalation:
    """An operation that waited for its provider past the contract's outage tolerance,
    handed to a person with the outage as evidence: when the wait began, the outage's
    start and the probes made, if a breaker was open."""
    outage = wait.outage
    return Escalation(
        EscalationReason.PROVIDER_UNAVAILABLE,
        Transition(
            source,
            S.ESCALATED,
            {
                "reason": str(EscalationReason.PROVIDER_UNAVAILABLE),
                "provider": wait.provider,
                "waited_seconds": round(wait.waited.total_seconds(), 3),
                "outage_tolerance_seconds": contract.outage_tolerance.total_seconds(),
                "outage_started_at": _iso(outage.outage_started_at if outage else None),
                "probes": outage.probes if outage else 0,
                "attempts": operation.attempts,
                "reconcile_attempts": operation.reconcile_attempts,
                "last_error": operation.last_error_class,
            },
            error_class=str(EscalationReason.PROVIDER_UNAVAILABLE),
        ),
    )


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="milliseconds")


def _refusal_may_hide_an_effect(operation: Operation, contract: ToolContract[Any]) -> bool:
    """Whether a provider's refusal leaves open that an earlier attempt landed (see
    :func:`after_attempt`)."""
    return operation.effect_possible and contract.side_effect not in (
        SideEffect.READ_ONLY,
        SideEffect.DEDUPLICATED_WRITE,
    )


def _effect_may_have_happened(
    operation: Operation, contract: ToolContract[Any], attempt: Attempt, reason: str
) -> Transition:
    """An attempt that ended for good on an operation whose effect may have happened:
    an unknown outcome, looked up at once (no delay: this attempt left nothing running)
    or, with no lookup, escalated in the same transaction."""
    unknown = Transition(
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        {"attempt": operation.attempts, "policy": reason},
        error_class=attempt.code,
    )
    if contract.reconcile is not None:
        return unknown
    failed = operation.model_copy(update={"last_error_class": attempt.code})
    return replace(unknown, then=escalation(failed, EscalationReason.EFFECT_POSSIBLE))


def after_lease_expired(operation: Operation) -> Transition:
    """An in-flight operation whose worker died or stalled past its lease: the effect
    may have happened, so it is an unknown outcome, never a retry."""
    return Transition(
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        {"attempt": operation.attempts, "policy": "lease_expired"},
        error_class="lease_expired",
    )


def for_unknown_outcome(
    operation: Operation, contract: ToolContract[Any], *, now: datetime
) -> LookUp | Transition | Escalation:
    """What an unknown outcome due for attention needs, per side-effect class: a lookup,
    a retry (only where repeating the call is safe), or a person."""
    if contract.on_unknown is OnUnknown.ESCALATE:
        return escalation(operation, EscalationReason.BY_CONTRACT)
    if contract.reconcile is not None:
        if operation.reconcile_attempts >= contract.retry.reconcile_max_attempts:
            return escalation(operation, EscalationReason.RECONCILE_BUDGET_EXHAUSTED)
        return LookUp()
    if operation.attempts >= contract.retry.max_attempts:
        return escalation(operation, EscalationReason.RETRY_BUDGET_EXHAUSTED)
    if contract.side_effect in (SideEffect.READ_ONLY, SideEffect.IDEMPOTENT_WRITE):
        return _retry_unknown(operation, contract)
    if contract.side_effect is SideEffect.DEDUPLICATED_WRITE:
        retry = _retry_unknown(operation, contract)
        # The replay runs after its backoff. (If the consumers are slower than that, the
        # claim asks again: blind_replay_too_late.)
        delay = retry.delay or timedelta(0)
        if not replay.replay_window_passed(operation, contract, now=now, after=delay):
            return retry
        return escalation(operation, EscalationReason.DEDUPE_WINDOW_PASSED)
    return escalation(operation, EscalationReason.NO_RECONCILE)


def blind_replay_too_late(
    operation: Operation, contract: ToolContract[Any], *, now: datetime
) -> bool:
    """Whether calling this prepared operation now could replay a deduplication key the
    target may already have forgotten.

    A deduplicated write with no lookup is retried blind, trusting the target to answer
    a replayed key without acting twice; that holds only inside the window counted from
    the first attempt. The retry was decided inside it, but queues, backoffs and slow
    consumers can carry the call past it, so the claim asks again. An operation never
    attempted has no key to replay; one with a lookup only comes back to ``prepared``
    when the lookup proved the effect absent (or a person said so while the window
    still held: the operator's retry asks the same question). The window and its
    margins are :func:`outbox.replay.replay_window_passed`'s."""
    return can_outlive_dedupe_window(contract) and replay.replay_window_passed(
        operation, contract, now=now
    )


def can_outlive_dedupe_window(contract: ToolContract[Any]) -> bool:
    """Whether a call of this tool can come too late for :func:`blind_replay_too_late`: a
    deduplicated write retried blind, with no lookup. For any other tool the question
    never arises, and the claim need not build the row as it was to ask it."""
    return contract.reconcile is None and contract.side_effect is SideEffect.DEDUPLICATED_WRITE


def escalation_before_replay(operation: Operation) -> Escalation:
    """A prepared operation that must not be called again (see
    :func:`blind_replay_too_late`) goes to a person instead, never to the provider."""
    return Escalation(
        EscalationReason.DEDUPE_WINDOW_PASSED,
        Transition(
            S.PREPARED,
            S.ESCALATED,
            {
                "reason": str(EscalationReason.DEDUPE_WINDOW_PASSED),
                "attempts": operation.attempts,
                "last_error": operation.last_error_class,
            },
        ),
    )


def after_lookup(
    operation: Operation, contract: ToolContract[Any], result: Reconciliation
) -> Transition | Escalation | Deferral:
    """Where a lookup leaves the unknown outcome it was made for."""
    if isinstance(result, Found):
        return Transition(
            S.OUTCOME_UNKNOWN,
            S.COMMITTED,
            {"result": "committed", "method": "lookup"},
            event=EventName.RECONCILED,
            provider_reference=result.provider_reference,
            result=dict(result.result),
            reconcile_attempt=True,
        )
    if isinstance(result, NotFound):
        # Proven absent: the only road back to an attempt for a non-repeatable write,
        # and the only thing that clears the operation's effect_possible.
        return Transition(
            S.OUTCOME_UNKNOWN,
            S.PREPARED,
            {"result": "not_found", "method": "lookup"},
            event=EventName.RECONCILED,
            reconcile_attempt=True,
            effect_disproved=True,
        )
    if operation.reconcile_attempts + 1 >= contract.retry.reconcile_max_attempts:
        return escalation(
            operation, EscalationReason.RECONCILE_BUDGET_EXHAUSTED, lookup_code=result.code
        )
    return Deferral(result.code, contract.retry.backoff(operation.reconcile_attempts + 1))


def escalation(
    operation: Operation, reason: EscalationReason, *, lookup_code: str | None = None
) -> Escalation:
    """An unknown outcome handed to a person, with the evidence gathered so far (a
    ``lookup_code`` when an inconclusive lookup is what exhausted the budget)."""
    return Escalation(
        reason,
        Transition(
            S.OUTCOME_UNKNOWN,
            S.ESCALATED,
            {
                "reason": str(reason),
                "attempts": operation.attempts,
                "reconcile_attempts": operation.reconcile_attempts + (1 if lookup_code else 0),
                "last_error": lookup_code or operation.last_error_class,
            },
            error_class=lookup_code,
            reconcile_attempt=lookup_code is not None,
        ),
    )


def _retry_unknown(operation: Operation, contract: ToolContract[Any]) -> Transition:
    return Transition(
        S.OUTCOME_UNKNOWN,
        S.PREPARED,
        {"policy": f"retry_{contract.side_effect}"},
        delay=contract.retry.backoff(max(1, operation.attempts)),
    )
