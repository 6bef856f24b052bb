"""What the latency phases may claim: an open-loop schedule, how late the writer wrote,
and whether the rate it achieved lets a figure be called "@N/s".

A writer that falls behind its schedule measures a saturated system at whatever rate it
managed, not the rate it was offered; these rules keep the report from saying otherwise.
Pure functions, unit-tested in tests/unit/test_bench_latency.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# A decision written more than this past its scheduled time counts as late.
LATE_TOLERANCE_S = 0.010
# Below this share of the offered rate, a run did not keep its schedule: its figures are
# labelled with the rate achieved and "fell behind", never "@offered/s".
KEPT_RATE_SHARE = 0.95
# The latency phases run at these shares of the drain rate the same system was measured at,
# and at the same shares of its sustained rate.
DRAIN_SHARES = (0.5, 0.8)
# The sustained rate leaves out the first second of writing: the consumers' first bursts
# and the writers' first round trips are not the steady state.
SUSTAINED_WARM_UP_S = 1.0


def scheduled(rate: float, seconds: float, writer: int = 0, writers: int = 1) -> list[int]:
    """The decisions writer ``writer`` of ``writers`` owns: decision n is due n / rate
    seconds after the common start, and the writers take every ``writers``-th one, so
    together they keep one schedule of round(rate * seconds) decisions."""
    if rate <= 0 or seconds <= 0:
        raise ValueError("rate and seconds must be positive")
    if not 0 <= writer < writers:
        raise ValueError(f"writer {writer} is not one of {writers}")
    total = max(1, round(rate * seconds))
    return list(range(writer, total, writers))


def due_at(start: float, rate: float, decision: int) -> float:
    return start + decision / rate


@dataclass
class Lateness:
    """How far behind its schedule a writer wrote: late means past due by more than the
    tolerance when the write began."""

    tolerance_s: float = LATE_TOLERANCE_S
    decisions: int = 0
    late: int = 0
    worst_s: float = 0.0

    def record(self, due: float, began: float) -> None:
        self.decisions += 1
        behind = began - due
        if behind > self.tolerance_s:
            self.late += 1
        self.worst_s = max(self.worst_s, behind)

    def merge(self, other: Lateness) -> None:
        self.decisions += other.decisions
        self.late += other.late
        self.worst_s = max(self.worst_s, other.worst_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tolerance_ms": self.tolerance_s * 1000,
            "decisions": self.decisions,
            "late": self.late,
            "worst_ms": round(self.worst_s * 1000, 3),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lateness:
        return cls(
            tolerance_s=float(data["tolerance_ms"]) / 1000,
            decisions=int(data["decisions"]),
            late=int(data["late"]),
            worst_s=float(data["worst_ms"]) / 1000,
        )


def achieved_rate(decisions: int, first_due: float, last_written: float) -> float:
    """Decisions per second from the schedule's start to the last write's end: a writer
    that kept its schedule comes out at the offered rate (one interval short of it)."""
    span = last_written - first_due
    return decisions / span if span > 0 else math.nan


@dataclass(frozen=True)
class Pace:
    """The rate a latency phase was offered and the one its writers achieved."""

    offered_per_s: float
    achieved_per_s: float
    lateness: Lateness = field(default_factory=Lateness)

    @property
    def kept(self) -> bool:
        return (
            not math.isnan(self.achieved_per_s)
            and self.achieved_per_s >= KEPT_RATE_SHARE * self.offered_per_s
        )

    @property
    def late_share(self) -> float:
        decisions = self.lateness.decisions
        return self.lateness.late / decisions if decisions else math.nan

    def label(self) -> str:
        """ "@N/s" only for a run that kept its schedule."""
        if self.kept:
            return f"@{self.offered_per_s:,.0f}/s"
        return f"FELL BEHIND: {self.achieved_per_s:,.0f}/s of {self.offered_per_s:,.0f}/s offered"

    def describe(self) -> str:
        """Offered, achieved and late, for every latency line."""
        tolerance = self.lateness.tolerance_s * 1000
        return (
            f"offered {self.offered_per_s:,.0f}/s, achieved {self.achieved_per_s:,.0f}/s, "
            f"late {self.late_share:.1%} (> {tolerance:g} ms behind schedule)"
        )


def rates_from_drain(drain_per_s: float, shares: Sequence[float] = DRAIN_SHARES) -> list[float]:
    """The offered rates of the latency phases: each share of a measured rate (the drain's
    or the sustained one), whole decisions per second, at least 1. None without a rate to
    take them from."""
    if math.isnan(drain_per_s) or drain_per_s <= 0:
        return []
    return [float(max(1, math.floor(drain_per_s * share))) for share in shares]


def sustained_rate(
    commits: Iterable[float], effects: Iterable[float], warm_up_s: float = SUSTAINED_WARM_UP_S
) -> float:
    """Effects per second while decisions were still being written as fast as the writers
    could: effects timed from ``warm_up_s`` after the first commit to the last commit,
    over that span (epoch seconds, both). The decisions and their effects share one
    machine here, as they do in any latency phase, which a drain of a written backlog
    does not; NaN when the writing did not last past the warm-up."""
    written = list(commits)
    if not written:
        return math.nan
    start, end = min(written) + warm_up_s, max(written)
    if end <= start:
        return math.nan
    inside = sum(1 for at in effects if start <= at <= end)
    return inside / (end - start)
