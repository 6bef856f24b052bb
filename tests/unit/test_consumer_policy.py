"""The consumer's decisions, row by row of the per-class retry table (docs/design.md section 5).

| class | retryable-before-send | outcome_unknown |
|---|---|---|
| read_only | retry | retry |
| idempotent_write | retry | retry same input |
| deduplicated_write | retry same key | retry same key only inside the dedupe window |
| non_repeatable_write | retry | reconcile; retry only after not_found; else escalate |

A contract with a lookup is always looked up before anything else, whatever its class.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from consumer.policy import (
    LEASE_LOST_BEFORE_CALL,
    Attempt,
    AttemptOutcome,
    CallbackDecision,
    Deferral,
    Escalation,
    EscalationReason,
    LookUp,
    Transition,
    after_attempt,
    after_callback,
    after_lease_expired,
    after_lookup,
    contradicted_lookup,
    escalation_before_replay,
    for_unknown_outcome,
    replay_window_passed,
)
from outbox.callback_policy import CallbackPolicy, CallbackProvider, CallbackStatus, Scheme
from outbox.contracts import OnUnknown, Registry, RetryPolicy, SideEffect, ToolContract
from outbox.models import Callback, CallbackOutcome, Operation
from outbox.operator.rules import retry_refusal
from outbox.outcomes import (
    EffectResult,
    ExecutionContext,
    Found,
    NotFound,
    Reconciliation,
    StillUnknown,
)
from outbox.replay import replay_window_passed as window_passed
from outbox.states import EventName, OperationState, is_legal

S = OperationState
NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
DEADLINE = timedelta(seconds=30)
WINDOW = timedelta(hours=1)
# No jitter, so every delay is exact: 1 s, then doubling.
RETRY = RetryPolicy(
    max_attempts=3,
    initial_backoff=timedelta(seconds=1),
    max_backoff=timedelta(minutes=1),
    multiplier=2.0,
    jitter=0.0,
    reconcile_max_attempts=3,
)
EVERY_CLASS = list(SideEffect)


class Refund(BaseModel):
    amount_cents: int


async def never_called(tool_input: Refund, context: ExecutionContext) -> EffectResult:
    raise AssertionError("the policy never calls a tool")


async def never_looked_up(tool_input: Refund, context: ExecutionContext) -> Reconciliation:
    raise AssertionError("the policy never looks anything up")


def contract(
    side_effect: SideEffect,
    *,
    lookup: bool = False,
    on_unknown: OnUnknown = OnUnknown.RECONCILE,
    retry: RetryPolicy = RETRY,
) -> ToolContract[Refund]:
    return ToolContract(
        name="send_refund",
        version=1,
        input_model=Refund,
        side_effect=side_effect,
        execute=never_called,
        retry=retry,
        reconcile=never_looked_up if lookup else None,
        dedupe_window=WINDOW if side_effect is SideEffect.DEDUPLICATED_WRITE else None,
        on_unknown=on_unknown,
        deadline=DEADLINE,
    )


def operation(**changes: Any) -> Operation:
    """An operation in flight on its first attempt, begun a minute ago."""
    fields: dict[str, Any] = {
        "id": uuid.UUID("3f2a4c1e-0d6b-4f7a-9c1e-2b3d4e5f6a7b"),
        "run_id": "run",
        "decision_key": None,
        "tool_name": "send_refund",
        "tool_version": 1,
        "side_effect": SideEffect.NON_REPEATABLE_WRITE,
        "input": {"amount_cents": 1250},
        "input_fingerprint": "ab" * 32,
        "requires_approval": False,
        "state": S.IN_FLIGHT,
        "attempts": 1,
        "reconcile_attempts": 0,
        "lease_token": 7,
        "lease_owner": "host:1:0001",
        "lease_expires_at": NOW + timedelta(seconds=35),
        "next_attempt_at": NOW - timedelta(minutes=1),
        "first_attempt_at": NOW - timedelta(minutes=1),
        "provider_reference": None,
        "result": None,
        "last_error_class": None,
        "effect_possible": False,
        "created_at": NOW - timedelta(minutes=1),
        "updated_at": NOW,
    }
    fields.update(changes)
    return Operation(**fields)


def unknown(**changes: Any) -> Operation:
    """An operation whose first attempt's outcome is unknown, due for attention."""
    return operation(
        state=S.OUTCOME_UNKNOWN,
        last_error_class="response_lost",
        **{"effect_possible": True, **changes},
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
        Attempt(AttemptOutcome.OUTCOME_UNKNOWN, "deadline_exceeded"),
    )

    assert move == Transition(
        S.IN_FLIGHT,
        S.OUTCOME_UNKNOWN,
        {"attempt": 1},
        error_class="deadline_exceeded",
        delay=RETRY.initial_backoff,
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


# --- every decision, whatever the inputs


contracts = st.builds(
    contract,
    st.sampled_from(EVERY_CLASS),
    lookup=st.booleans(),
    on_unknown=st.sampled_from(list(OnUnknown)),
)
operations = st.builds(
    unknown,
    attempts=st.integers(1, 5),
    reconcile_attempts=st.integers(0, 5),
    first_attempt_at=st.one_of(st.none(), st.just(NOW - 2 * WINDOW), st.just(NOW)),
    effect_possible=st.booleans(),
)
attempts = st.builds(
    Attempt,
    st.sampled_from(list(AttemptOutcome)),
    st.sampled_from(["connect_refused", LEASE_LOST_BEFORE_CALL, "response_lost"]),
    st.just(EffectResult(provider_reference="re_1")),
)
lookups = st.one_of(
    st.just(Found(provider_reference="re_1")), st.just(NotFound()), st.just(StillUnknown())
)


def moves(decision: object) -> Transition | None:
    if isinstance(decision, Escalation):
        return decision.transition
    return decision if isinstance(decision, Transition) else None


@given(operations, contracts, attempts, lookups)
def test_every_decision_is_a_legal_move_and_only_a_lookup_reopens_a_non_repeatable_write(
    operation: Operation,
    contract: ToolContract[Refund],
    attempt: Attempt,
    lookup: Reconciliation,
) -> None:
    in_flight = operation.model_copy(update={"state": S.IN_FLIGHT})
    unknown_next = moves(for_unknown_outcome(operation, contract, now=NOW))
    looked_up = moves(after_lookup(operation, contract, lookup))

    attempted = after_attempt(in_flight, contract, attempt)
    for source, move in [
        (S.IN_FLIGHT, attempted),
        (S.IN_FLIGHT, after_lease_expired(in_flight)),
        (S.OUTCOME_UNKNOWN, unknown_next),
        (S.OUTCOME_UNKNOWN, looked_up),
    ]:
        if move is not None:
            assert move.source is source
            assert is_legal(move.source, move.target)
            if move.then is not None:
                then = move.then.transition
                assert then.source is move.target
                assert is_legal(then.source, then.target)
            # Only a lookup that found nothing may clear a possible effect.
            assert not move.effect_disproved or isinstance(lookup, NotFound)
    if operation.effect_possible and contract.side_effect is not SideEffect.READ_ONLY:
        # Whatever this attempt came to, the earlier one may have done the effect.
        assert attempted.target is not S.REJECTED or (
            attempt.outcome is AttemptOutcome.REJECTED
            and contract.side_effect is SideEffect.DEDUPLICATED_WRITE
        )
    if contract.side_effect is SideEffect.NON_REPEATABLE_WRITE:
        assert unknown_next is None or unknown_next.target is not S.PREPARED
        if looked_up is not None and looked_up.target is S.PREPARED:
            assert isinstance(lookup, NotFound)


# --- at the claim: a blind replay decided inside the window may run after it


def prepared_again(**changes: Any) -> Operation:
    """A deduplicated write sent back to prepared for a blind replay of its key."""
    return operation(
        state=S.PREPARED,
        lease_owner=None,
        lease_expires_at=None,
        last_error_class="response_lost",
        **changes,
    )


def test_a_replay_claimed_while_the_call_still_fits_the_window_runs() -> None:
    first = NOW - WINDOW + DEADLINE + timedelta(seconds=1)

    assert not replay_window_passed(
        prepared_again(first_attempt_at=first), contract(SideEffect.DEDUPLICATED_WRITE), now=NOW
    )


def test_a_replay_claimed_too_late_for_the_window_goes_to_a_person() -> None:
    first = NOW - WINDOW + DEADLINE
    late = prepared_again(first_attempt_at=first, attempts=1)

    assert replay_window_passed(late, contract(SideEffect.DEDUPLICATED_WRITE), now=NOW)
    decision = escalation_before_replay(late)
    assert decision.reason is EscalationReason.DEDUPE_WINDOW_PASSED
    assert (decision.transition.source, decision.transition.target) == (S.PREPARED, S.ESCALATED)


@pytest.mark.parametrize(
    ("side_effect", "lookup", "attempts"),
    [
        (SideEffect.DEDUPLICATED_WRITE, False, 0),  # never attempted: no key to replay
        (SideEffect.DEDUPLICATED_WRITE, True, 1),  # back only after a lookup proved absence
        (SideEffect.IDEMPOTENT_WRITE, False, 1),  # the target dedupes for good
        (SideEffect.NON_REPEATABLE_WRITE, True, 1),
        (SideEffect.READ_ONLY, False, 1),
    ],
)
def test_only_a_blind_replay_of_a_deduplicated_write_is_bound_by_the_window(
    side_effect: SideEffect, lookup: bool, attempts: int
) -> None:
    long_ago = NOW - 10 * WINDOW

    assert not replay_window_passed(
        prepared_again(created_at=long_ago, first_attempt_at=long_ago, attempts=attempts),
        contract(side_effect, lookup=lookup),
        now=NOW,
    )


@given(
    attempts=st.integers(0, 3),
    first_attempt_ago=st.one_of(
        st.none(), st.timedeltas(min_value=timedelta(0), max_value=2 * WINDOW)
    ),
    lookup=st.booleans(),
)
def test_an_operators_retry_is_offered_only_where_the_consumer_would_call(
    attempts: int, first_attempt_ago: timedelta | None, lookup: bool
) -> None:
    """The consumer's claim and `ops resolve --not-committed`/the console's retry ask one
    question (outbox.replay) with one set of margins: the operator is never offered a
    retry the consumer would escalate at its claim, and without a lookup they agree."""
    dedupe = contract(SideEffect.DEDUPLICATED_WRITE, lookup=lookup)
    registry = Registry()
    registry.register(dedupe)
    row = prepared_again(
        side_effect=SideEffect.DEDUPLICATED_WRITE,
        attempts=attempts,
        first_attempt_at=None if first_attempt_ago is None else NOW - first_attempt_ago,
        created_at=NOW - 2 * WINDOW,
    )

    consumer_escalates = replay_window_passed(row, dedupe, now=NOW)
    operator_refuses = retry_refusal(registry, row, NOW) is not None

    assert operator_refuses is window_passed(row, dedupe, now=NOW)
    if not lookup:
        assert operator_refuses is consumer_escalates
    elif consumer_escalates:
        raise AssertionError("a contract with a lookup is never escalated at its claim")


# --- provider callbacks: one test per row of docs/design.md section 5, "Callbacks" -------

PAYMENTS = CallbackProvider(name="payments", scheme=Scheme.STRIPE, read=lambda payload, _: None)
OTHER = CallbackProvider(name="other", scheme=Scheme.STRIPE, read=lambda payload, _: None)


def with_callbacks(
    side_effect: SideEffect = SideEffect.NON_REPEATABLE_WRITE,
    *,
    settles: bool = False,
    definitive: bool = False,
    provider: CallbackProvider = PAYMENTS,
    lookup: bool = True,
    wait: timedelta = timedelta(0),
    on_unknown: OnUnknown = OnUnknown.RECONCILE,
) -> ToolContract[Refund]:
    return dataclasses.replace(
        contract(side_effect, lookup=lookup, on_unknown=on_unknown),
        callbacks=CallbackPolicy(
            provider, settles_unknown=settles, failure_definitive=definitive, wait=wait
        ),
    )


def callback(status: str, reference: str | None = "re_1", **changes: Any) -> Callback:
    fields: dict[str, Any] = {
        "id": 41,
        "provider": "payments",
        "event_id": "evt_1",
        "status": CallbackStatus(status),
        "named_operation_id": operation().id,
        "operation_id": operation().id,
        "provider_reference": reference,
        "payload_digest": "d" * 64,
        "received_at": NOW,
        "outcome": None,
        "applied_at": None,
    }
    fields.update(changes)
    return Callback(**fields)


def at(state: OperationState, **changes: Any) -> Operation:
    settled = {"lease_owner": None, "lease_expires_at": None}
    if state is S.IN_FLIGHT:
        settled = {}
    return operation(state=state, **{**settled, **changes})


def test_a_success_settles_an_unknown_outcome_where_the_contract_lets_it() -> None:
    decision = after_callback(
        unknown(lease_owner=None, lease_expires_at=None),
        with_callbacks(settles=True),
        callback("committed"),
        success_reported=False,
    )

    assert decision == CallbackDecision(
        CallbackOutcome.SETTLED,
        Transition(
            S.OUTCOME_UNKNOWN,
            S.COMMITTED,
            {"result": "committed", "method": "callback", "callback": 41},
            event=EventName.RECONCILED,
            provider_reference="re_1",
        ),
    )


def test_a_success_is_evidence_where_the_contract_does_not_let_it_settle() -> None:
    decision = after_callback(
        unknown(), with_callbacks(settles=False), callback("committed"), success_reported=False
    )
    assert decision == CallbackDecision(CallbackOutcome.EVIDENCE)


@pytest.mark.parametrize("status", ["committed", "rejected", "pending"])
def test_any_callback_waits_while_an_attempt_is_in_flight(status: str) -> None:
    decision = after_callback(
        at(S.IN_FLIGHT), with_callbacks(settles=True, definitive=True), callback(status),
        success_reported=False,
    )  # fmt: skip
    assert decision is None


@pytest.mark.parametrize(
    ("recorded", "reported"), [("re_1", "re_1"), ("re_1", None), (None, "re_1")]
)
def test_a_success_for_a_committed_operation_with_its_reference_confirms_it(
    recorded: str | None, reported: str | None
) -> None:
    decision = after_callback(
        at(S.COMMITTED, provider_reference=recorded),
        with_callbacks(settles=True),
        callback("committed", reported),
        success_reported=False,
    )
    assert decision == CallbackDecision(CallbackOutcome.CONFIRMED)


def test_a_success_with_another_reference_contradicts_a_committed_operation() -> None:
    decision = after_callback(
        at(S.COMMITTED, provider_reference="re_1"),
        with_callbacks(settles=True),
        callback("committed", "re_2"),
        success_reported=False,
    )
    # Terminal stays terminal: the contradiction is evidence, a metric and an alert.
    assert decision == CallbackDecision(
        CallbackOutcome.CONTRADICTED, contradiction="reference_differs"
    )


def test_a_success_for_a_prepared_operation_is_escalated_as_a_contradiction() -> None:
    decision = after_callback(
        at(S.PREPARED, attempts=1), with_callbacks(), callback("committed"), success_reported=False
    )

    assert decision is not None
    assert (decision.outcome, decision.contradiction) == (
        CallbackOutcome.CONTRADICTED,
        "success_for_prepared",
    )
    assert decision.move is not None
    assert (decision.move.source, decision.move.target) == (S.PREPARED, S.ESCALATED)
    assert decision.move.error_class == "contradicted"
    assert decision.move.attributes["callback"] == 41


@pytest.mark.parametrize(
    "side_effect", [SideEffect.IDEMPOTENT_WRITE, SideEffect.DEDUPLICATED_WRITE]
)
def test_a_success_for_a_blind_retry_the_class_allows_is_evidence_not_a_contradiction(
    side_effect: SideEffect,
) -> None:
    # The earlier attempt's outcome was unknown and its class let it be sent again: the
    # retry meets the same effect (same input, or same key), so nobody is unaccounted for.
    retried = at(S.PREPARED, attempts=1, effect_possible=True, side_effect=side_effect)

    decision = after_callback(
        retried, with_callbacks(side_effect, settles=True, lookup=False), callback("committed"),
        success_reported=False,
    )  # fmt: skip

    assert decision == CallbackDecision(CallbackOutcome.EVIDENCE)


@pytest.mark.parametrize(
    ("side_effect", "effect_possible"),
    [
        (SideEffect.NON_REPEATABLE_WRITE, True),  # an operator said "not committed"
        (SideEffect.DEDUPLICATED_WRITE, False),  # a lookup proved it absent
        (SideEffect.IDEMPOTENT_WRITE, False),  # never attempted, or never sent
    ],
)
def test_a_success_for_a_prepared_operation_nothing_explains_is_a_contradiction(
    side_effect: SideEffect, effect_possible: bool
) -> None:
    prepared = at(S.PREPARED, attempts=1, effect_possible=effect_possible, side_effect=side_effect)

    decision = after_callback(
        prepared, with_callbacks(side_effect), callback("committed"), success_reported=False
    )

    assert decision is not None
    assert decision.contradiction == "success_for_prepared"


def test_a_success_contradicts_a_rejected_operation_and_leaves_it_rejected() -> None:
    decision = after_callback(
        at(S.REJECTED), with_callbacks(settles=True), callback("committed"), success_reported=False
    )
    assert decision == CallbackDecision(
        CallbackOutcome.CONTRADICTED, contradiction="success_for_rejected"
    )


def test_a_definitive_failure_authorises_a_retry_like_a_lookups_not_found() -> None:
    decision = after_callback(
        unknown(), with_callbacks(definitive=True), callback("rejected"), success_reported=False
    )

    assert decision == CallbackDecision(
        CallbackOutcome.RETRY,
        Transition(
            S.OUTCOME_UNKNOWN,
            S.PREPARED,
            {"result": "not_found", "method": "callback", "callback": 41},
            event=EventName.RECONCILED,
            effect_disproved=True,
        ),
    )


def test_a_failure_after_a_reported_success_is_a_contradiction_for_a_person() -> None:
    decision = after_callback(
        unknown(), with_callbacks(definitive=True), callback("rejected"), success_reported=True
    )

    assert decision is not None
    assert (decision.outcome, decision.contradiction) == (
        CallbackOutcome.CONTRADICTED,
        "failure_and_success",
    )
    assert decision.move is not None
    assert (decision.move.source, decision.move.target) == (S.OUTCOME_UNKNOWN, S.ESCALATED)


def test_a_failure_that_is_not_definitive_is_evidence() -> None:
    decision = after_callback(
        unknown(), with_callbacks(settles=True), callback("rejected"), success_reported=False
    )
    assert decision == CallbackDecision(CallbackOutcome.EVIDENCE)


def test_a_failure_after_success_contradicts_a_committed_operation() -> None:
    decision = after_callback(
        at(S.COMMITTED, provider_reference="re_1"),
        with_callbacks(settles=True, definitive=True),
        callback("rejected"),
        success_reported=False,
    )
    assert decision == CallbackDecision(
        CallbackOutcome.CONTRADICTED, contradiction="failure_after_success"
    )


def test_a_failure_confirms_a_rejected_operation() -> None:
    decision = after_callback(
        at(S.REJECTED), with_callbacks(), callback("rejected"), success_reported=False
    )
    assert decision == CallbackDecision(CallbackOutcome.CONFIRMED)


def test_a_failure_for_a_prepared_operation_is_evidence() -> None:
    decision = after_callback(
        at(S.PREPARED), with_callbacks(definitive=True), callback("rejected"),
        success_reported=False,
    )  # fmt: skip
    assert decision == CallbackDecision(CallbackOutcome.EVIDENCE)


@pytest.mark.parametrize(
    "state", [S.PREPARED, S.COMMITTED, S.REJECTED, S.OUTCOME_UNKNOWN, S.ESCALATED]
)
def test_a_pending_callback_is_evidence_wherever_the_operation_stands(
    state: OperationState,
) -> None:
    decision = after_callback(
        at(state), with_callbacks(settles=True, definitive=True), callback("pending"),
        success_reported=True,
    )  # fmt: skip
    assert decision == CallbackDecision(CallbackOutcome.EVIDENCE)


@pytest.mark.parametrize("status", ["committed", "rejected", "pending"])
def test_any_callback_for_an_escalated_operation_is_evidence_for_its_person(status: str) -> None:
    decision = after_callback(
        at(S.ESCALATED), with_callbacks(settles=True, definitive=True), callback(status),
        success_reported=False,
    )  # fmt: skip
    assert decision == CallbackDecision(CallbackOutcome.EVIDENCE)


@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("status", ["committed", "rejected", "pending"])
def test_another_providers_callback_neither_settles_nor_contradicts(
    state: OperationState, status: str
) -> None:
    for policy in (
        with_callbacks(settles=True, provider=OTHER),
        contract(SideEffect.IDEMPOTENT_WRITE),
    ):
        decision = after_callback(at(state), policy, callback(status), success_reported=False)
        expected = None if state is S.IN_FLIGHT else CallbackDecision(CallbackOutcome.EVIDENCE)
        assert decision == expected


@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("status", ["committed", "rejected", "pending"])
@pytest.mark.parametrize("settles", [True, False])
@pytest.mark.parametrize("definitive", [True, False])
def test_no_callback_moves_an_operation_backwards_or_along_an_illegal_edge(
    state: OperationState, status: str, settles: bool, definitive: bool
) -> None:
    decision = after_callback(
        at(state), with_callbacks(settles=settles, definitive=definitive), callback(status),
        success_reported=definitive,
    )  # fmt: skip
    if decision is None or decision.move is None:
        return
    move = decision.move
    assert move.source is state
    assert is_legal(move.source, move.target)
    # Only an unknown outcome is settled, and only a prepared or unknown one escalated.
    assert (move.source, move.target) in {
        (S.OUTCOME_UNKNOWN, S.COMMITTED),
        (S.OUTCOME_UNKNOWN, S.PREPARED),
        (S.OUTCOME_UNKNOWN, S.ESCALATED),
        (S.PREPARED, S.ESCALATED),
    }
    assert move.target is not S.PREPARED or (status == "rejected" and definitive)


def test_a_lookups_not_found_against_a_reported_success_is_a_contradiction() -> None:
    decision = contradicted_lookup(unknown(reconcile_attempts=1), callback("committed"))

    assert (decision.outcome, decision.contradiction) == (
        CallbackOutcome.CONTRADICTED,
        "not_found_and_success",
    )
    assert decision.move is not None
    assert (decision.move.source, decision.move.target) == (S.OUTCOME_UNKNOWN, S.ESCALATED)
    assert decision.move.attributes["reason"] == "contradicted"


@pytest.mark.parametrize("lookup", [True, False])
def test_an_unknown_outcome_without_a_lookup_waits_for_its_callback(lookup: bool) -> None:
    tool = with_callbacks(
        settles=True, lookup=lookup, wait=timedelta(minutes=2), on_unknown=OnUnknown.ESCALATE
    )

    move = after_attempt(operation(), tool, Attempt(AttemptOutcome.OUTCOME_UNKNOWN, "lost"))

    # A lookup does not wait: it runs one backoff after, as before.
    assert move.delay == (timedelta(seconds=1) if lookup else timedelta(minutes=2))
