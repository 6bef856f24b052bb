"""What follows a lookup, and an attempt after an unknown outcome."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from consumer.policy import (
    Attempt,
    AttemptOutcome,
    Deferral,
    Escalation,
    EscalationReason,
    Transition,
    after_attempt,
    after_lookup,
    for_unknown_outcome,
)
from outbox.contracts import RetryPolicy, SideEffect
from outbox.models import Operation
from outbox.outcomes import Found, NotFound, StillUnknown
from outbox.states import EventName

from support.policy_cases import EVERY_CLASS, NOW, S, contract, operation, unknown

# --- after a lookup


def test_a_found_effect_is_committed_with_the_reference_the_lookup_gave() -> None:
    move = after_lookup(
        unknown(),
        contract(SideEffect.NON_REPEATABLE_WRITE, lookup=True),
        Found(provider_reference="tk_9", result={"status": "open"}),
    )

    assert move == Transition(
        S.OUTCOME_UNKNOWN,
        S.COMMITTED,
        {"result": "committed", "method": "lookup"},
        event=EventName.RECONCILED,
        provider_reference="tk_9",
        result={"status": "open"},
        reconcile_attempt=True,
    )


def test_a_proven_absent_effect_goes_back_to_prepared_for_a_new_attempt() -> None:
    move = after_lookup(
        unknown(), contract(SideEffect.NON_REPEATABLE_WRITE, lookup=True), NotFound()
    )

    assert move == Transition(
        S.OUTCOME_UNKNOWN,
        S.PREPARED,
        {"result": "not_found", "method": "lookup"},
        event=EventName.RECONCILED,
        reconcile_attempt=True,
        effect_disproved=True,
    )


def test_an_inconclusive_lookup_is_tried_again_after_a_growing_backoff() -> None:
    decision = after_lookup(
        unknown(reconcile_attempts=1),
        contract(SideEffect.NON_REPEATABLE_WRITE, lookup=True),
        StillUnknown("provider_unavailable"),
    )

    assert decision == Deferral("provider_unavailable", timedelta(seconds=2))


def test_the_last_inconclusive_lookup_escalates_with_its_evidence() -> None:
    decision = after_lookup(
        unknown(reconcile_attempts=2),
        contract(SideEffect.NON_REPEATABLE_WRITE, lookup=True),
        StillUnknown("lookup_timeout"),
    )

    assert decision == Escalation(
        EscalationReason.RECONCILE_BUDGET_EXHAUSTED,
        Transition(
            S.OUTCOME_UNKNOWN,
            S.ESCALATED,
            {
                "reason": "reconcile_budget_exhausted",
                "attempts": 1,
                "reconcile_attempts": 3,
                "last_error": "lookup_timeout",
            },
            error_class="lookup_timeout",
            reconcile_attempt=True,
        ),
    )


# --- after an attempt on an operation whose effect may have happened


def after_unknown(**changes: Any) -> Operation:
    """In flight again after an earlier attempt's outcome was unknown."""
    return operation(effect_possible=True, last_error_class="response_lost", **changes)


def escalated_as_effect_possible(attempts: int, code: str, policy: str) -> Transition:
    return Transition(
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        {"attempt": attempts, "policy": policy},
        error_class=code,
        then=Escalation(
            EscalationReason.EFFECT_POSSIBLE,
            Transition(
                S.OUTCOME_UNKNOWN,
                S.ESCALATED,
                {
                    "reason": "effect_possible",
                    "attempts": attempts,
                    "reconcile_attempts": 0,
                    "last_error": code,
                },
            ),
        ),
    )


WRITES = [side_effect for side_effect in EVERY_CLASS if side_effect is not SideEffect.READ_ONLY]


@pytest.mark.parametrize("side_effect", WRITES)
def test_a_failure_before_send_past_the_budget_after_an_unknown_outcome_goes_to_a_person(
    side_effect: SideEffect,
) -> None:
    move = after_attempt(
        after_unknown(attempts=3),
        contract(side_effect),
        Attempt(AttemptOutcome.NOT_SENT, "connect_refused"),
    )

    assert move == escalated_as_effect_possible(
        3, "connect_refused", "retry_budget_exhausted_after_unknown"
    )


def test_a_code_the_contract_does_not_retry_after_an_unknown_outcome_goes_to_a_person() -> None:
    only_refusals = RetryPolicy(
        max_attempts=3, jitter=0.0, retryable_codes=frozenset({"connect_refused"})
    )

    move = after_attempt(
        after_unknown(attempts=2),
        contract(SideEffect.IDEMPOTENT_WRITE, retry=only_refusals),
        Attempt(AttemptOutcome.NOT_SENT, "dns_failure"),
    )

    assert move.target is S.OUTCOME_UNKNOWN
    assert move.then is not None
    assert move.then.reason is EscalationReason.EFFECT_POSSIBLE


@pytest.mark.parametrize("side_effect", WRITES)
def test_with_a_lookup_a_possible_effect_past_the_budget_is_looked_up_at_once(
    side_effect: SideEffect,
) -> None:
    move = after_attempt(
        after_unknown(attempts=3),
        contract(side_effect, lookup=True),
        Attempt(AttemptOutcome.NOT_SENT, "connect_refused"),
    )

    # No delay: nothing of this attempt is still running for the lookup to wait for.
    assert move == Transition(
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        {"attempt": 3, "policy": "retry_budget_exhausted_after_unknown"},
        error_class="connect_refused",
    )


@pytest.mark.parametrize("side_effect", EVERY_CLASS)
def test_a_failure_before_send_within_the_budget_after_an_unknown_outcome_still_retries(
    side_effect: SideEffect,
) -> None:
    move = after_attempt(
        after_unknown(attempts=2),
        contract(side_effect),
        Attempt(AttemptOutcome.NOT_SENT, "connect_refused"),
    )

    assert (move.target, move.then) == (S.PREPARED, None)


def test_a_read_has_no_effect_to_be_unsure_of_so_past_the_budget_it_ends_rejected() -> None:
    for outcome in (AttemptOutcome.NOT_SENT, AttemptOutcome.REJECTED):
        move = after_attempt(
            after_unknown(attempts=3), contract(SideEffect.READ_ONLY), Attempt(outcome, "no")
        )

        assert (move.target, move.then) == (S.REJECTED, None)


@pytest.mark.parametrize(
    "side_effect", [SideEffect.IDEMPOTENT_WRITE, SideEffect.NON_REPEATABLE_WRITE]
)
def test_a_refusal_after_an_unknown_outcome_says_nothing_of_the_earlier_attempt(
    side_effect: SideEffect,
) -> None:
    # "Already closed": the target judges the request against what the first one did.
    move = after_attempt(
        after_unknown(attempts=2),
        contract(side_effect),
        Attempt(AttemptOutcome.REJECTED, "ticket_closed"),
    )

    assert move == escalated_as_effect_possible(2, "ticket_closed", "rejected_after_unknown")


def test_a_refusal_of_a_replayed_deduplication_key_is_the_first_requests_answer() -> None:
    move = after_attempt(
        after_unknown(attempts=2),
        contract(SideEffect.DEDUPLICATED_WRITE),
        Attempt(AttemptOutcome.REJECTED, "card_declined"),
    )

    assert move == Transition(S.IN_FLIGHT, S.REJECTED, {"attempt": 2}, error_class="card_declined")


def test_a_blind_retry_of_an_unknown_outcome_does_not_clear_the_possible_effect() -> None:
    move = for_unknown_outcome(unknown(), contract(SideEffect.IDEMPOTENT_WRITE), now=NOW)

    assert isinstance(move, Transition)
    assert move.target is S.PREPARED
    assert not move.effect_disproved
