"""What a provider callback does to an operation (the design's callback table)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest

from consumer.callback_decisions import CallbackDecision, after_callback, contradicted_lookup
from consumer.policy import Attempt, AttemptOutcome, Transition, after_attempt
from outbox.callback_policy import CallbackPolicy, CallbackProvider, CallbackStatus, Scheme
from outbox.contracts import OnUnknown, SideEffect, ToolContract
from outbox.models import Callback, CallbackOutcome
from outbox.states import EventName, OperationState, is_legal

from support.policy_cases import NOW, Refund, S, at, contract, operation, unknown

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


def test_a_failure_that_is_not_definitive_is_evidence_beside_a_reported_success() -> None:
    # A soft bounce, then the delivery: a provider that may report a failure of one
    # step of an effect it later completes has not said both. Only a failure declared
    # definitive contradicts a success on record.
    decision = after_callback(
        unknown(), with_callbacks(settles=False), callback("rejected"), success_reported=True
    )
    assert decision == CallbackDecision(CallbackOutcome.EVIDENCE)


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
