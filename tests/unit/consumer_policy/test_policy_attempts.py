"""What follows an attempt, per side-effect class, and when a lookup comes first."""

from __future__ import annotations

from datetime import timedelta

import pytest

from consumer.policy import (
    LEASE_LOST_BEFORE_CALL,
    Attempt,
    AttemptOutcome,
    Escalation,
    EscalationReason,
    LookUp,
    ProviderWait,
    Transition,
    Unavailability,
    after_attempt,
    after_lease_expired,
    for_unknown_outcome,
)
from outbox.breaker import BreakerState, ProviderHealth
from outbox.contracts import OnUnknown, RetryPolicy, SideEffect
from outbox.outcomes import EffectResult
from outbox.states import Waiting

from support.policy_cases import (
    DEADLINE,
    EVERY_CLASS,
    NOW,
    RETRY,
    WINDOW,
    S,
    contract,
    operation,
    unknown,
)

# --- after an attempt: the same for every class, except an unknown outcome's follow-up


@pytest.mark.parametrize("side_effect", EVERY_CLASS)
def test_a_confirmed_effect_commits_with_its_reference(side_effect: SideEffect) -> None:
    effect = EffectResult(provider_reference="re_1", result={"status": "succeeded"})

    move = after_attempt(
        operation(attempts=2),
        contract(side_effect),
        Attempt(AttemptOutcome.COMMITTED, "ok", effect),
    )

    assert move == Transition(
        S.IN_FLIGHT,
        S.COMMITTED,
        {"attempt": 2},
        provider_reference="re_1",
        result={"status": "succeeded"},
    )


@pytest.mark.parametrize("side_effect", EVERY_CLASS)
def test_a_definitive_rejection_ends_it_without_retry(side_effect: SideEffect) -> None:
    move = after_attempt(
        operation(),
        contract(side_effect),
        Attempt(AttemptOutcome.REJECTED, "amount_exceeds_payment"),
    )

    assert move == Transition(
        S.IN_FLIGHT, S.REJECTED, {"attempt": 1}, error_class="amount_exceeds_payment"
    )


@pytest.mark.parametrize("side_effect", EVERY_CLASS)
@pytest.mark.parametrize(("attempts", "backoff_seconds"), [(1, 1), (2, 2)])
def test_a_failure_before_send_is_retried_within_the_budget(
    side_effect: SideEffect, attempts: int, backoff_seconds: int
) -> None:
    move = after_attempt(
        operation(attempts=attempts),
        contract(side_effect),
        Attempt(AttemptOutcome.NOT_SENT, "connect_refused"),
    )

    assert move == Transition(
        S.IN_FLIGHT,
        S.PREPARED,
        {"attempt": attempts, "policy": "retry_not_sent"},
        error_class="connect_refused",
        delay=timedelta(seconds=backoff_seconds),
    )


@pytest.mark.parametrize("side_effect", EVERY_CLASS)
def test_a_failure_before_send_past_the_budget_ends_rejected(side_effect: SideEffect) -> None:
    move = after_attempt(
        operation(attempts=3),
        contract(side_effect),
        Attempt(AttemptOutcome.NOT_SENT, "connect_refused"),
    )

    assert move == Transition(
        S.IN_FLIGHT,
        S.REJECTED,
        {"attempt": 3, "policy": "retry_budget_exhausted"},
        error_class="connect_refused",
    )


def test_a_failure_before_send_with_a_code_the_contract_does_not_retry_ends_rejected() -> None:
    only_refusals = RetryPolicy(
        max_attempts=3, jitter=0.0, retryable_codes=frozenset({"connect_refused"})
    )

    move = after_attempt(
        operation(),
        contract(SideEffect.IDEMPOTENT_WRITE, retry=only_refusals),
        Attempt(AttemptOutcome.NOT_SENT, "dns_failure"),
    )

    assert move.target is S.REJECTED


def test_a_call_never_made_is_retried_whatever_the_budget_and_the_codes() -> None:
    only_refusals = RetryPolicy(
        max_attempts=3, jitter=0.0, retryable_codes=frozenset({"connect_refused"})
    )

    move = after_attempt(
        operation(attempts=3),
        contract(SideEffect.NON_REPEATABLE_WRITE, lookup=True, retry=only_refusals),
        Attempt(AttemptOutcome.NOT_SENT, LEASE_LOST_BEFORE_CALL),
    )

    assert (move.target, move.error_class) == (S.PREPARED, LEASE_LOST_BEFORE_CALL)


@pytest.mark.parametrize("side_effect", EVERY_CLASS)
def test_an_unknown_outcome_is_recorded_and_waits_one_step_before_anything_else(
    side_effect: SideEffect,
) -> None:
    move = after_attempt(
        operation(),
        contract(side_effect),
        Attempt(AttemptOutcome.OUTCOME_UNKNOWN, "malformed_response"),
    )

    assert move == Transition(
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        {"attempt": 1},
        error_class="malformed_response",
        delay=RETRY.initial_backoff,
    )


@pytest.mark.parametrize("code", ["deadline_exceeded", "connection_lost", "http_503"])
def test_an_unknown_outcome_that_got_no_answer_starts_the_wait_for_the_provider(
    code: str,
) -> None:
    move = after_attempt(
        operation(),
        contract(SideEffect.DEDUPLICATED_WRITE),
        Attempt(AttemptOutcome.OUTCOME_UNKNOWN, code),
    )

    assert (move.target, move.waiting, move.attempt_refunded) == (
        S.OUTCOME_UNKNOWN,
        Waiting.START,
        False,
    )


def test_an_expired_lease_is_an_unknown_outcome_not_a_retry() -> None:
    move = after_lease_expired(operation(attempts=2))

    assert move == Transition(
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        {"attempt": 2, "policy": "lease_expired"},
        error_class="lease_expired",
    )


# --- an unknown outcome due for attention: the outcome_unknown column


@pytest.mark.parametrize("side_effect", [SideEffect.READ_ONLY, SideEffect.IDEMPOTENT_WRITE])
def test_a_class_that_may_repeat_the_call_retries_the_same_input(side_effect: SideEffect) -> None:
    decision = for_unknown_outcome(unknown(attempts=2), contract(side_effect), now=NOW)

    assert decision == Transition(
        S.OUTCOME_UNKNOWN,
        S.PREPARED,
        {"policy": f"retry_{side_effect}"},
        delay=timedelta(seconds=2),
    )


@pytest.mark.parametrize(
    "side_effect",
    [SideEffect.READ_ONLY, SideEffect.IDEMPOTENT_WRITE, SideEffect.DEDUPLICATED_WRITE],
)
def test_a_retry_without_lookup_escalates_past_the_attempt_budget(side_effect: SideEffect) -> None:
    decision = for_unknown_outcome(unknown(attempts=3), contract(side_effect), now=NOW)

    assert decision == Escalation(
        EscalationReason.RETRY_BUDGET_EXHAUSTED,
        Transition(
            S.OUTCOME_UNKNOWN,
            S.ESCALATED,
            {
                "reason": "retry_budget_exhausted",
                "attempts": 3,
                "reconcile_attempts": 0,
                "last_error": "response_lost",
            },
        ),
    )


def test_a_deduplicated_write_retries_the_same_key_inside_the_window() -> None:
    # The replay waits its one-second backoff, may run a whole deadline, and must end
    # inside the window: one second to spare.
    first = NOW - WINDOW + DEADLINE + timedelta(seconds=2)

    decision = for_unknown_outcome(
        unknown(first_attempt_at=first), contract(SideEffect.DEDUPLICATED_WRITE), now=NOW
    )

    assert decision == Transition(
        S.OUTCOME_UNKNOWN,
        S.PREPARED,
        {"policy": "retry_deduplicated_write"},
        delay=timedelta(seconds=1),
    )


def test_a_deduplicated_write_escalates_once_a_call_could_outlive_the_window() -> None:
    # A replay sent after its backoff could still be running when the target forgets
    # the key.
    first = NOW - WINDOW + DEADLINE + timedelta(seconds=1)

    decision = for_unknown_outcome(
        unknown(first_attempt_at=first), contract(SideEffect.DEDUPLICATED_WRITE), now=NOW
    )

    assert isinstance(decision, Escalation)
    assert decision.reason is EscalationReason.DEDUPE_WINDOW_PASSED


def test_the_dedupe_window_runs_from_the_first_attempt_or_else_from_the_decision() -> None:
    dedupe = contract(SideEffect.DEDUPLICATED_WRITE)
    long_ago = NOW - 2 * WINDOW

    attempted_recently = for_unknown_outcome(
        unknown(created_at=long_ago, first_attempt_at=NOW - timedelta(minutes=1)), dedupe, now=NOW
    )
    never_attempted = for_unknown_outcome(
        unknown(created_at=long_ago, first_attempt_at=None), dedupe, now=NOW
    )

    assert isinstance(attempted_recently, Transition)
    assert isinstance(never_attempted, Escalation)


@pytest.mark.parametrize("side_effect", EVERY_CLASS)
def test_a_contract_with_a_lookup_is_looked_up_before_anything_else(
    side_effect: SideEffect,
) -> None:
    decision = for_unknown_outcome(unknown(), contract(side_effect, lookup=True), now=NOW)

    assert decision == LookUp()


def test_a_lookup_is_not_tried_again_past_the_reconcile_budget() -> None:
    decision = for_unknown_outcome(
        unknown(reconcile_attempts=3),
        contract(SideEffect.NON_REPEATABLE_WRITE, lookup=True),
        now=NOW,
    )

    assert isinstance(decision, Escalation)
    assert decision.reason is EscalationReason.RECONCILE_BUDGET_EXHAUSTED
    assert decision.transition.attributes["reconcile_attempts"] == 3
    assert not decision.transition.reconcile_attempt


@pytest.mark.parametrize("lookup", [False, True])
def test_a_contract_that_says_escalate_goes_to_a_person_at_once(lookup: bool) -> None:
    decision = for_unknown_outcome(
        unknown(),
        contract(SideEffect.NON_REPEATABLE_WRITE, lookup=lookup, on_unknown=OnUnknown.ESCALATE),
        now=NOW,
    )

    assert isinstance(decision, Escalation)
    assert decision.reason is EscalationReason.BY_CONTRACT


def test_a_non_repeatable_write_without_a_lookup_is_never_retried() -> None:
    # The registry refuses such a contract; the policy still never repeats the call.
    decision = for_unknown_outcome(unknown(), contract(SideEffect.NON_REPEATABLE_WRITE), now=NOW)

    assert isinstance(decision, Escalation)
    assert decision.reason is EscalationReason.NO_RECONCILE


# --- a provider that could not take the attempt: waiting, never a person within tolerance


@pytest.mark.parametrize("side_effect", EVERY_CLASS)
@pytest.mark.parametrize("unavailability", list(Unavailability))
def test_an_attempt_the_provider_could_not_take_waits_and_gives_its_attempt_back(
    side_effect: SideEffect, unavailability: Unavailability
) -> None:
    wait = ProviderWait("payments", timedelta(seconds=12), timedelta(minutes=5))

    move = after_attempt(
        operation(attempts=5),
        contract(side_effect),
        Attempt(AttemptOutcome.UNAVAILABLE, "http_503", unavailability=unavailability),
        wait,
    )

    assert move == Transition(
        S.IN_FLIGHT,
        S.PREPARED,
        {
            "attempt": 5,
            "policy": "wait_for_provider",
            "provider": "payments",
            "unavailable": str(unavailability),
        },
        error_class="http_503",
        delay=timedelta(seconds=12),
        waiting=Waiting.START,
        attempt_refunded=True,
    )


def test_an_attempt_past_the_outage_tolerance_goes_to_a_person_with_the_outage() -> None:
    outage = ProviderHealth(
        provider="payments",
        state=BreakerState.OPEN,
        outage_started_at=NOW - timedelta(hours=1, minutes=2),
        probes=9,
    )
    wait = ProviderWait("payments", timedelta(seconds=12), timedelta(hours=1), outage)

    move = after_attempt(
        operation(attempts=2),
        contract(SideEffect.DEDUPLICATED_WRITE),
        Attempt(AttemptOutcome.UNAVAILABLE, "provider_unavailable"),
        wait,
    )

    assert (move.target, move.attempt_refunded) == (S.PREPARED, True)
    assert move.then is not None
    assert move.then.reason is EscalationReason.PROVIDER_UNAVAILABLE
    escalated = move.then.transition
    assert (escalated.source, escalated.target) == (S.PREPARED, S.ESCALATED)
    assert escalated.attributes == {
        "reason": "provider_unavailable",
        "provider": "payments",
        "waited_seconds": 3600.0,
        "outage_tolerance_seconds": 3600.0,
        "outage_started_at": (NOW - timedelta(hours=1, minutes=2)).isoformat(
            timespec="milliseconds"
        ),
        "probes": 9,
        "attempts": 1,
        "reconcile_attempts": 0,
        "last_error": "provider_unavailable",
    }


def test_a_wait_just_inside_the_tolerance_is_still_a_wait() -> None:
    wait = ProviderWait("payments", timedelta(seconds=1), timedelta(minutes=59, seconds=59))

    move = after_attempt(
        operation(),
        contract(SideEffect.NON_REPEATABLE_WRITE, lookup=True),
        Attempt(AttemptOutcome.UNAVAILABLE, "connect_failed"),
        wait,
    )

    assert (move.target, move.then) == (S.PREPARED, None)
