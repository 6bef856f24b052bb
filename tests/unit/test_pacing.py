"""Backpressure and the liveness decision: an AIMD limit halves on overload (once per
burst), widens by one per window of healthy work, and stays within its bounds; a
transaction past its soft deadline runs on only while the server is working on it."""

from __future__ import annotations

import pytest

from outbox.connections import is_working
from outbox.pacing import AIMDLimit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_overload_halves_the_limit_once_per_cooldown() -> None:
    clock = Clock()
    seen: list[int] = []
    limit = AIMDLimit(most=16, cooldown=1.0, on_change=seen.append, clock=clock)

    assert limit.overloaded()
    # The other failures of the same burst are the same signal.
    assert not limit.overloaded()
    clock.now = 1.0
    assert limit.overloaded()

    assert (limit.limit, seen, limit.decreases) == (4, [8, 4], 2)


def test_the_limit_never_falls_below_its_least() -> None:
    clock = Clock()
    limit = AIMDLimit(most=4, least=2, cooldown=0.0, clock=clock)
    for _ in range(5):
        limit.overloaded()

    assert limit.limit == 2


def test_healthy_work_widens_by_one_per_window_up_to_the_most() -> None:
    limit = AIMDLimit(most=4, cooldown=0.0)
    limit.overloaded()
    limit.overloaded()
    assert limit.limit == 1

    widened = [limit.succeeded() for _ in range(1 + 2 + 3 + 10)]

    assert limit.limit == 4
    # One step after each full window at the limit of the moment: 1, then 2, then 3.
    assert [i for i, moved in enumerate(widened) if moved] == [0, 2, 5]


def test_a_slow_transaction_is_overload_and_a_quick_one_a_success() -> None:
    limit = AIMDLimit(most=8, slow_after=0.5, cooldown=0.0)

    assert limit.observe(0.6)
    assert limit.limit == 4
    assert not limit.observe(0.1)  # one success of a window of four
    assert limit.limit == 4


def test_an_overload_restarts_the_window() -> None:
    limit = AIMDLimit(most=8, cooldown=0.0)
    limit.overloaded()  # 4
    for _ in range(3):
        limit.succeeded()
    limit.overloaded()  # 2, and the three successes no longer count
    limit.succeeded()

    assert limit.limit == 2


@pytest.mark.parametrize(("least", "most", "factor"), [(0, 4, 0.5), (5, 4, 0.5), (1, 4, 1.0)])
def test_impossible_limits_are_refused(least: int, most: int, factor: float) -> None:
    with pytest.raises(ValueError, match=r"least|factor"):
        AIMDLimit(most=most, least=least, factor=factor)


@pytest.mark.parametrize(
    ("state", "idle_for", "working"),
    [
        # Running a statement, waiting for a lock or the disk: the server is working.
        ("active", 30.0, True),
        # Between statements, answered a moment ago: the client is sending the next.
        ("idle in transaction", 0.2, True),
        # Answered long ago and heard nothing since: the link is silent.
        ("idle in transaction", 3.0, False),
        ("idle in transaction (aborted)", 0.0, False),
        ("idle", 0.0, False),
        # No such backend: the server ended the session.
        ("gone", 0.0, False),
    ],
)
def test_the_liveness_decision(state: str, idle_for: float, working: bool) -> None:
    assert is_working(state, idle_for) is working


def test_a_short_deadline_asks_for_a_more_recent_answer() -> None:
    assert is_working("idle in transaction", 0.4, recent=1.0)
    assert not is_working("idle in transaction", 0.4, recent=0.25)
