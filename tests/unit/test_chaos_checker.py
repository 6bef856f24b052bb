"""The chaos checker's rules for overload (#22) and callbacks (#25): which escalations a
fault excuses, what breaks the verdict, the callback counts from the event log, and the
recovery time after an overload. No services: events and samples are made up here."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from harness.checker import (
    ESCALATION_SHARE_LIMIT,
    RECOVERY_BOUND_SECONDS,
    Sample,
    Verdict,
    check_sequence,
    escalation_excused,
    longest_outage,
    quiet_rate,
    recovery_seconds,
)
from outbox.models import OperationEvent
from outbox.states import OperationState

OPERATION = uuid.uuid4()
NOW = datetime.now(UTC)


def event(name: str, **attributes: str | int) -> OperationEvent:
    return OperationEvent(
        id=0, operation_id=OPERATION, name=name, attributes=attributes, created_at=NOW
    )


PREPARED = event("operation.prepared")
ATTEMPTED = event("operation.attempted")
UNKNOWN = event("operation.outcome_unknown", **{"from": "in_flight", "to": "outcome_unknown"})


def test_an_email_whose_success_callback_came_before_its_escalation_is_not_excused() -> None:
    # The provider had already said it was delivered: handing it to a person is the
    # runtime's failure, not the fault's.
    assert escalation_excused("escalate_by_contract", has_lookup=False)
    assert not escalation_excused(
        "escalate_by_contract", has_lookup=False, callback_came_first=True
    )


TOLERANCE = timedelta(minutes=2)
SHORT = timedelta(seconds=60)  # an outage the runtime must wait out
LONG = timedelta(minutes=5)  # one a person may be handed


@pytest.mark.parametrize("reason", ["escalate_by_contract", "provider_unavailable"])
def test_an_outcome_gone_unknown_on_the_outages_own_answer_is_never_excused(reason: str) -> None:
    # The sandbox's outage says nothing was done: an email that went to a person for it,
    # even after an outage longer than any tolerance, was the runtime's mistake.
    assert escalation_excused(reason, has_lookup=False, outage=LONG, outage_tolerance=TOLERANCE)
    assert not escalation_excused(
        reason,
        has_lookup=False,
        outage=LONG,
        outage_tolerance=TOLERANCE,
        unknown_on_outage_answer=True,
    )


@pytest.mark.parametrize(
    ("reason", "has_lookup", "outage", "excused"),
    [
        # A tool with no lookup: the provider kept the outcome unknown, a person decides.
        ("escalate_by_contract", False, timedelta(0), True),
        ("effect_possible", False, timedelta(0), True),
        # A lookup that could not ask costs no budget (#44): an outage shorter than the
        # tolerance forces no escalation, however long it was.
        ("reconcile_budget_exhausted", True, timedelta(0), False),
        ("reconcile_budget_exhausted", True, timedelta(seconds=5), False),
        ("reconcile_budget_exhausted", True, SHORT, False),
        ("reconcile_budget_exhausted", True, TOLERANCE, False),
        ("reconcile_budget_exhausted", True, LONG, True),
        # Waiting past the tolerance is what hands an operation to a person.
        ("provider_unavailable", True, SHORT, False),
        ("provider_unavailable", True, TOLERANCE, False),
        ("provider_unavailable", True, LONG, True),
        ("provider_unavailable", False, LONG, True),
        ("provider_unavailable", False, SHORT, False),
        # Never forced by a fault: the consumers always lived and served every tool.
        ("undeliverable", True, LONG, False),
        ("undeliverable", False, LONG, False),
        ("contradicted", False, LONG, False),
        ("tampered", True, LONG, False),
        ("escalate_by_contract", True, LONG, False),
    ],
)
def test_which_escalations_a_fault_forces(
    reason: str, has_lookup: bool, outage: timedelta, excused: bool
) -> None:
    assert (
        escalation_excused(reason, has_lookup=has_lookup, outage=outage, outage_tolerance=TOLERANCE)
        is excused
    )


@pytest.mark.parametrize("reason", ["provider_unavailable", "reconcile_budget_exhausted"])
def test_an_outage_excuses_nothing_for_a_tool_whose_tolerance_is_not_known(reason: str) -> None:
    assert not escalation_excused(reason, has_lookup=True, outage=LONG, outage_tolerance=None)


@pytest.mark.parametrize(
    ("spans", "seconds"),
    [
        ([], 0.0),
        ([(10.0, 15.0)], 5.0),
        # Apart: the provider came back between them.
        ([(10.0, 15.0), (20.0, 80.0)], 60.0),
        # A lookups outage inside a whole outage, one reaching past it, one touching it.
        ([(10.0, 70.0), (20.0, 25.0)], 60.0),
        ([(10.0, 70.0), (65.0, 90.0)], 80.0),
        ([(30.0, 40.0), (10.0, 30.0)], 30.0),
    ],
)
def test_the_longest_outage_joins_windows_that_overlap(
    spans: list[tuple[float, float]], seconds: float
) -> None:
    assert longest_outage(spans) == timedelta(seconds=seconds)


def held_verdict(**fields: object) -> Verdict:
    verdict = Verdict(decisions=300, effects=300)
    for name, value in fields.items():
        setattr(verdict, name, value)
    return verdict


def test_a_clean_verdict_holds() -> None:
    assert held_verdict().held


def test_one_undeliverable_escalation_breaks_the_verdict() -> None:
    verdict = held_verdict(effects=299, escalated=1, escalations_excused=0)
    verdict.escalation_reasons["undeliverable"] = 1

    assert verdict.undeliverable == 1
    assert not verdict.held


@pytest.mark.parametrize(("unexcused", "held"), [(3, True), (4, False)])
def test_more_than_one_percent_escalated_without_a_forcing_fault_breaks_it(
    unexcused: int, held: bool
) -> None:
    # 300 decisions: 3 is 1%, 4 is over; the forced ones (30 here) never count.
    verdict = held_verdict(effects=300 - unexcused - 30, escalated=unexcused + 30)
    verdict.escalations_excused = 30
    verdict.escalation_reasons["escalate_by_contract"] = 30
    verdict.escalation_reasons["reconcile_budget_exhausted"] = unexcused

    assert verdict.escalated_share == pytest.approx(unexcused / 300)
    assert (verdict.escalated_share <= ESCALATION_SHARE_LIMIT) is held
    assert verdict.held is held


def test_a_contradiction_breaks_the_verdict() -> None:
    assert not held_verdict(contradictions=1).held


@pytest.mark.parametrize(
    ("judged", "recovery_s", "held"),
    [
        (False, None, True),  # no overload ran: nothing to recover from
        (True, 0.0, True),
        (True, RECOVERY_BOUND_SECONDS, True),
        (True, RECOVERY_BOUND_SECONDS + 0.1, False),
        (True, None, False),  # never recovered within the run
    ],
)
def test_recovery_past_thirty_seconds_breaks_the_verdict(
    judged: bool, recovery_s: float | None, held: bool
) -> None:
    assert held_verdict(recovery_judged=judged, recovery_s=recovery_s).held is held


@pytest.mark.parametrize(
    "email_fields",
    [{"committed_without_one_email": 1}, {"emails_without_an_effect_state": 1}],
)
def test_an_email_sent_twice_or_for_no_effect_state_breaks_the_verdict(
    email_fields: dict[str, int],
) -> None:
    assert not held_verdict(**email_fields).held


def test_callbacks_that_settle_or_retry_an_unknown_outcome_are_counted() -> None:
    settled, retried = Verdict(decisions=2), Verdict(decisions=2)
    by_callback: dict[str, str | int] = {
        "from": "outcome_unknown",
        "method": "callback",
        "callback": 1,
    }

    check_sequence(
        settled,
        "a",
        OperationState.COMMITTED,
        [
            PREPARED,
            ATTEMPTED,
            UNKNOWN,
            event("operation.reconciled", result="committed", to="committed", **by_callback),
        ],
    )
    check_sequence(
        retried,
        "b",
        OperationState.PREPARED,
        [
            PREPARED,
            ATTEMPTED,
            UNKNOWN,
            event("operation.reconciled", result="not_found", to="prepared", **by_callback),
        ],
    )

    assert (settled.settled_by_callback, settled.retried_by_callback) == (1, 0)
    assert (retried.settled_by_callback, retried.retried_by_callback) == (0, 1)
    assert settled.illegal_sequences == retried.illegal_sequences == 0


def test_a_contradicted_operation_is_counted_once_with_its_escalation_reason() -> None:
    verdict = Verdict(decisions=1)
    not_found = event(
        "operation.reconciled",
        result="not_found",
        method="lookup",
        **{"from": "outcome_unknown", "to": "prepared"},
    )
    contradicted = event("operation.contradicted", reason="success_for_prepared")
    escalated = event(
        "operation.escalated", reason="contradicted", **{"from": "prepared", "to": "escalated"}
    )

    check_sequence(
        verdict,
        "a",
        OperationState.ESCALATED,
        [PREPARED, ATTEMPTED, UNKNOWN, not_found, contradicted, escalated],
    )

    assert verdict.contradictions == 1
    assert verdict.escalation_reasons == {"contradicted": 1}
    assert verdict.illegal_sequences == 0


def test_a_contradiction_that_moves_nothing_is_counted_too() -> None:
    verdict = Verdict(decisions=1)
    committed = event("operation.committed", **{"from": "in_flight", "to": "committed"})
    contradicted = event("operation.contradicted", reason="reference_differs")

    check_sequence(
        verdict, "a", OperationState.COMMITTED, [PREPARED, ATTEMPTED, committed, contradicted]
    )

    assert verdict.contradictions == 1
    assert not verdict.held


def test_the_stale_sweeps_escalation_is_counted_by_its_reason() -> None:
    verdict = Verdict(decisions=1)
    undeliverable = event(
        "operation.escalated",
        reason="undeliverable",
        requeues=3,
        **{"from": "prepared", "to": "escalated"},
    )

    check_sequence(verdict, "a", OperationState.ESCALATED, [PREPARED, undeliverable])

    assert verdict.undeliverable == 1


def samples(*rows: tuple[float, int, int, int]) -> list[Sample]:
    return [Sample(at, recorded, goodput, settled) for at, recorded, goodput, settled in rows]


def test_the_quiet_rate_counts_from_the_first_answer_to_the_first_fault() -> None:
    run = samples(
        (0.0, 0, 0, 0),
        (1.0, 10, 0, 0),  # the daemons still starting
        (2.0, 20, 5, 5),
        (3.0, 30, 15, 15),
        (4.0, 40, 25, 25),
        (5.0, 50, 0, 0),  # after the first fault: not quiet
    )

    assert quiet_rate(run, until=4.5) == pytest.approx(10.0)


def test_a_quiet_phase_with_too_few_answers_has_no_rate() -> None:
    run = samples((0.0, 0, 0, 0), (1.0, 10, 0, 0), (2.0, 20, 2, 2), (3.0, 30, 4, 4))

    assert quiet_rate(run, until=3.0) is None


def test_recovery_is_the_first_window_after_the_overload_back_at_ninety_percent() -> None:
    # Quiet rate 10/s; the overload ends at t=10; the backlog stays high throughout.
    run = samples(
        (10.0, 200, 100, 100),
        (12.0, 220, 104, 104),  # 2/s
        (14.0, 240, 110, 110),
        (16.0, 260, 128, 128),  # from t=14: 9/s
        (18.0, 280, 146, 146),
        (20.0, 300, 164, 164),
    )

    assert recovery_seconds(run, ended_at=10.0, rate=10.0, quiet_backlog=5, window=4.0) == (
        pytest.approx(4.0)
    )


def test_recovery_is_at_once_when_nothing_waits() -> None:
    run = samples((10.0, 300, 290, 300), (11.0, 300, 290, 300))

    assert recovery_seconds(run, ended_at=10.0, rate=10.0, quiet_backlog=5) == 0.0


def test_a_system_stuck_after_the_overload_never_recovers() -> None:
    # Metastable: the backlog stays and goodput stays at 1/s.
    run = samples(*((10.0 + n, 300, 100 + n, 100 + n) for n in range(60)))

    assert recovery_seconds(run, ended_at=10.0, rate=10.0, quiet_backlog=5) is None


def test_an_overload_that_outlasts_the_runs_work_is_judged_by_the_last_sample() -> None:
    # Seen in a sweep: everything settled, sampling stopped, and the overload's end came
    # with the daemons' stop: no sample after it, so "never" though nothing waited.
    settled = [Sample(0.0, 10, 0, 0), Sample(10.0, 300, 300, 300)]
    assert recovery_seconds(settled, 12.0, rate=10.0, quiet_backlog=5) == 0.0
    unsettled = [Sample(0.0, 10, 0, 0), Sample(10.0, 300, 250, 250)]
    assert recovery_seconds(unsettled, 12.0, rate=10.0, quiet_backlog=5) is None


def test_a_runtime_keeping_up_with_the_stream_has_recovered_below_the_quiet_rate() -> None:
    # Seen in a sweep: the quiet rate (12.5/s) was measured while the start-up backlog
    # drained, above the 10/s the stream offers. After the overload the runtime answers
    # everything offered, with a few decisions always in hand; 90 % of 12.5 is out of
    # reach, and the runtime has recovered at once.
    run = samples(*((10.0 + n, 200 + 10 * n, 190 + 10 * n, 190 + 10 * n) for n in range(60)))

    assert recovery_seconds(run, ended_at=10.0, rate=12.5, quiet_backlog=5) == 0.0


def test_a_runtime_falling_behind_the_stream_has_not_recovered() -> None:
    # The same stream, answered at 6/s: the backlog grows, nothing was recovered.
    run = samples(*((10.0 + n, 200 + 10 * n, 190 + 6 * n, 190 + 6 * n) for n in range(60)))

    assert recovery_seconds(run, ended_at=10.0, rate=12.5, quiet_backlog=5) is None


def test_decisions_waiting_for_a_callback_or_a_lookup_are_not_backlog() -> None:
    # Twenty unknown outcomes wait for their callbacks or their next lookup; everything
    # else is answered. The runtime has nothing it could be doing faster.
    waiting = [Sample(10.0 + n, 300, 280, 280, waiting=20) for n in range(60)]
    assert recovery_seconds(waiting, ended_at=10.0, rate=10.0, quiet_backlog=5) == 0.0
    # The same twenty in hand and not waiting on anyone: not recovered.
    stuck = [Sample(10.0 + n, 300, 280, 280) for n in range(60)]
    assert recovery_seconds(stuck, ended_at=10.0, rate=10.0, quiet_backlog=5) is None
