"""Every decision is a legal move; a replay is bound by the dedupe window; an operator's
retry is offered where the consumer would call.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumer.policy import (
    Attempt,
    AttemptOutcome,
    Escalation,
    EscalationReason,
    Transition,
    after_attempt,
    after_lease_expired,
    after_lookup,
    blind_replay_too_late,
    can_outlive_dedupe_window,
    escalation_before_replay,
    for_unknown_outcome,
)
from outbox.contracts import OnUnknown, Registry, SideEffect, ToolContract
from outbox.models import Operation
from outbox.operator.rules import retry_refusal
from outbox.outcomes import Found, NotFound, Reconciliation, StillUnknown
from outbox.replay import replay_window_passed as window_passed
from outbox.states import is_legal

from support.policy_cases import (
    DEADLINE,
    EVERY_CLASS,
    NOW,
    WINDOW,
    Refund,
    S,
    attempts,
    contract,
    operation,
    unknown,
)

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

    assert not blind_replay_too_late(
        prepared_again(first_attempt_at=first), contract(SideEffect.DEDUPLICATED_WRITE), now=NOW
    )


def test_a_replay_claimed_too_late_for_the_window_goes_to_a_person() -> None:
    first = NOW - WINDOW + DEADLINE
    late = prepared_again(first_attempt_at=first, attempts=1)

    assert blind_replay_too_late(late, contract(SideEffect.DEDUPLICATED_WRITE), now=NOW)
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

    assert not blind_replay_too_late(
        prepared_again(created_at=long_ago, first_attempt_at=long_ago, attempts=attempts),
        contract(side_effect, lookup=lookup),
        now=NOW,
    )


@given(
    side_effect=st.sampled_from(EVERY_CLASS),
    lookup=st.booleans(),
    attempts=st.integers(0, 3),
    first_attempt_ago=st.timedeltas(min_value=timedelta(0), max_value=20 * WINDOW),
)
def test_the_claim_may_skip_the_window_only_for_a_tool_it_can_never_bind(
    side_effect: SideEffect, lookup: bool, attempts: int, first_attempt_ago: timedelta
) -> None:
    """The claim asks :func:`replay_window_passed` only when
    :func:`can_outlive_dedupe_window` says the tool can outlive the window: so no
    answer of the first may be True where the second says False."""
    tool = contract(side_effect, lookup=lookup)
    row = prepared_again(
        attempts=attempts, first_attempt_at=NOW - first_attempt_ago, created_at=NOW - 20 * WINDOW
    )

    if blind_replay_too_late(row, tool, now=NOW):
        assert can_outlive_dedupe_window(tool)
    assert can_outlive_dedupe_window(tool) is (
        side_effect is SideEffect.DEDUPLICATED_WRITE and not lookup
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

    consumer_escalates = blind_replay_too_late(row, dedupe, now=NOW)
    operator_refuses = retry_refusal(registry, row, NOW) is not None

    assert operator_refuses is window_passed(row, dedupe, now=NOW)
    if not lookup:
        assert operator_refuses is consumer_escalates
    elif consumer_escalates:
        raise AssertionError("a contract with a lookup is never escalated at its claim")
