"""The latency phases' rules (bench/latency.py): one open-loop schedule shared by the
writers, lateness past a stated tolerance, "@N/s" only for a run that kept its rate, and
the offered rates taken from the measured drain rate."""

from __future__ import annotations

import math

import pytest

from bench.latency import (
    KEPT_RATE_SHARE,
    LATE_TOLERANCE_S,
    Lateness,
    Pace,
    achieved_rate,
    due_at,
    rates_from_drain,
    scheduled,
    sustained_rate,
)


def test_one_writer_owns_the_whole_schedule() -> None:
    assert scheduled(rate=100, seconds=2) == list(range(200))


def test_writers_split_one_schedule_without_gaps_or_overlap() -> None:
    shares = [scheduled(rate=333, seconds=3, writer=w, writers=3) for w in range(3)]
    every = sorted(n for share in shares for n in share)
    assert every == list(range(999))
    assert shares[1][:3] == [1, 4, 7]


def test_a_schedule_has_at_least_one_decision() -> None:
    assert scheduled(rate=0.1, seconds=1) == [0]


@pytest.mark.parametrize(
    ("rate", "seconds", "writer", "writers"), [(0, 1, 0, 1), (1, 0, 0, 1), (1, 1, 2, 2)]
)
def test_a_schedule_refuses_what_cannot_be_kept(
    rate: float, seconds: float, writer: int, writers: int
) -> None:
    with pytest.raises(ValueError, match=r"must be positive|is not one of"):
        scheduled(rate, seconds, writer, writers)


def test_decisions_are_due_on_the_common_clock_whatever_the_writer() -> None:
    assert due_at(start=50.0, rate=200, decision=0) == 50.0
    assert due_at(start=50.0, rate=200, decision=400) == pytest.approx(52.0)


def test_late_means_past_due_by_more_than_the_tolerance() -> None:
    lateness = Lateness(tolerance_s=0.010)
    lateness.record(due=1.0, began=0.5)  # early: the writer slept until due
    lateness.record(due=0.0, began=0.010)  # at the tolerance: on time
    lateness.record(due=1.0, began=1.011)
    lateness.record(due=2.0, began=2.5)
    assert (lateness.decisions, lateness.late) == (4, 2)
    assert lateness.worst_s == pytest.approx(0.5)


def test_lateness_merges_across_writers_and_survives_json() -> None:
    first, second = Lateness(), Lateness()
    first.record(due=0.0, began=0.2)
    second.record(due=0.0, began=0.0)
    second.record(due=0.0, began=0.05)
    first.merge(Lateness.from_dict(second.as_dict()))
    assert (first.decisions, first.late) == (3, 2)
    assert first.worst_s == pytest.approx(0.2)
    assert first.as_dict()["tolerance_ms"] == LATE_TOLERANCE_S * 1000


def test_the_achieved_rate_runs_from_the_schedule_start_to_the_last_write() -> None:
    assert achieved_rate(1000, first_due=10.0, last_written=14.0) == 250.0
    assert math.isnan(achieved_rate(1, first_due=10.0, last_written=10.0))


def test_a_run_that_kept_its_rate_is_called_at_that_rate() -> None:
    pace = Pace(offered_per_s=500, achieved_per_s=KEPT_RATE_SHARE * 500)
    assert pace.kept
    assert pace.label() == "@500/s"


def test_a_run_that_fell_behind_is_never_called_at_the_offered_rate() -> None:
    # The case of issue #26: 500/s offered, 153/s reached, 9,999 of 10,000 late.
    lateness = Lateness(decisions=10_000, late=9_999)
    pace = Pace(offered_per_s=500, achieved_per_s=153, lateness=lateness)
    assert not pace.kept
    assert "@500/s" not in pace.label()
    assert pace.label() == "FELL BEHIND: 153/s of 500/s offered"
    assert pace.describe() == (
        "offered 500/s, achieved 153/s, late 100.0% (> 10 ms behind schedule)"
    )


def test_just_under_the_kept_share_fell_behind() -> None:
    assert not Pace(offered_per_s=1000, achieved_per_s=949.9).kept
    assert not Pace(offered_per_s=1000, achieved_per_s=math.nan).kept


def test_the_late_share_counts_every_writer() -> None:
    pace = Pace(100, 100, Lateness(decisions=200, late=3))
    assert pace.late_share == pytest.approx(0.015)
    assert math.isnan(Pace(100, 100).late_share)


def test_latency_rates_are_half_and_four_fifths_of_the_drain_rate() -> None:
    assert rates_from_drain(1532.7) == [766.0, 1226.0]
    assert rates_from_drain(1.0) == [1.0, 1.0]
    assert rates_from_drain(1000, shares=(0.25,)) == [250.0]


@pytest.mark.parametrize("drain", [math.nan, 0.0, -5.0])
def test_no_drain_rate_no_latency_rates(drain: float) -> None:
    assert rates_from_drain(drain) == []


def test_the_sustained_rate_counts_effects_while_decisions_were_written() -> None:
    # Decisions written from t=100 to t=111; the first second is the warm-up, so the
    # window is 101..111: 10 s.
    commits = [100.0 + n * 0.01 for n in range(1101)]
    effects = [99.0, 100.5] + [101.0 + n * 0.02 for n in range(501)] + [111.5, 120.0]
    assert sustained_rate(commits, effects) == pytest.approx(501 / 10)


def test_the_sustained_rate_is_not_the_drain_of_what_was_left_behind() -> None:
    # Writers finished at t=20 with a backlog that drained by t=60: only what was done
    # while they wrote counts.
    commits = [10.0 + n * 0.001 for n in range(10_001)]
    effects = [11.0 + n * 0.1 for n in range(91)] + [20.5 + n * 0.004 for n in range(9_910)]
    assert sustained_rate(commits, effects) == pytest.approx(91 / 9)


@pytest.mark.parametrize("commits", [[], [5.0], [5.0, 5.5]])
def test_no_sustained_rate_without_writing_past_the_warm_up(commits: list[float]) -> None:
    assert math.isnan(sustained_rate(commits, [5.2]))
