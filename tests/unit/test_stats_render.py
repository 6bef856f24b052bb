"""How `outbox stats` shows figures that are estimates: flagged in its JSON, "~" in its
table with a line saying what they are; and estimates kept to three significant
figures, which is all a sample of the table can say."""

from __future__ import annotations

import pytest

from outbox.operator.render import stats_json, stats_text
from outbox.states import OperationState
from outbox.store import Backlog, OperationStats
from outbox.store.operator import _about

S = OperationState


def _stats(estimated: frozenset[OperationState]) -> OperationStats:
    return OperationStats(
        by_tool={"send_refund": {"committed": 62_800, "rejected": 9_000, "escalated": 2}},
        backlog=Backlog(pending=0, oldest_age_seconds=0.0),
        pending_approvals=0,
        estimated=estimated,
    )


def test_estimated_states_are_named_in_the_json_and_marked_in_the_table() -> None:
    numbers = stats_json(_stats(frozenset((S.REJECTED, S.COMMITTED))))
    text = stats_text(numbers)

    assert numbers["estimated"] == ["committed", "rejected"]  # in the states' order
    assert numbers["by_state"]["committed"] == 62_800
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[1:3]}
    # prepared, in_flight, committed, rejected, outcome_unknown, escalated, total
    assert rows["send_refund"] == ["0", "0", "~62800", "~9000", "0", "2", "~71802"]
    assert rows["all"] == rows["send_refund"]
    assert "~ about: committed and rejected are estimated" in text


def test_counted_figures_carry_no_mark() -> None:
    numbers = stats_json(_stats(frozenset()))
    text = stats_text(numbers)

    assert numbers["estimated"] == []
    assert "~" not in text
    assert "about" not in text


@pytest.mark.parametrize(
    ("estimate", "shown"),
    [(0, 0), (7, 7), (999, 999), (62_776, 62_800), (1_234_567, 1_230_000), (99_951, 100_000)],
)
def test_an_estimate_keeps_three_significant_figures(estimate: int, shown: int) -> None:
    assert _about(estimate) == shown
