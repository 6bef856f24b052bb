"""The decision-to-outcome histogram's buckets are fine enough between one and fifteen
minutes that Grafana's p90 and p99 (``histogram_quantile`` over the buckets) are within
10% of the rows' own percentiles, for the spreads a backlog, a retry's backoff or a
callback wait produce."""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterator, Sequence

import pytest

from outbox.metrics import DECISION_BUCKETS

TOLERANCE = 0.10
SAMPLES = 5000


def histogram_quantile(q: float, bounds: Sequence[float], samples: Sequence[float]) -> float:
    """What Prometheus's histogram_quantile answers for these samples observed into
    buckets with these upper bounds: the bucket holding rank q*count, interpolated
    linearly between its bounds (from 0 for the first; the highest finite bound for the
    +Inf bucket)."""
    counts = [0] * (len(bounds) + 1)
    for sample in samples:
        # A bucket counts observations <= its bound (le).
        counts[bisect.bisect_left(bounds, sample)] += 1
    cumulative = []
    total = 0
    for count in counts:
        total += count
        cumulative.append(total)
    rank = q * total
    bucket = next(i for i, seen in enumerate(cumulative) if seen >= rank)
    if bucket == len(bounds):
        return bounds[-1]
    lower = 0.0 if bucket == 0 else bounds[bucket - 1]
    below = 0 if bucket == 0 else cumulative[bucket - 1]
    return lower + (bounds[bucket] - lower) * (rank - below) / (cumulative[bucket] - below)


def exact(q: float, samples: Sequence[float]) -> float:
    """The rows' percentile (nearest rank)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def spreads() -> Iterator[tuple[str, list[float]]]:
    """Decision-to-outcome durations between 60 s and 900 s, seeded so a run repeats."""
    rng = random.Random(49)

    def clipped(value: float) -> float:
        return min(900.0, max(60.0, value))

    yield "uniform", [rng.uniform(60, 900) for _ in range(SAMPLES)]
    yield (
        "a backlog with a tail",
        [
            rng.uniform(60, 150) if rng.random() < 0.85 else rng.uniform(150, 900)
            for _ in range(SAMPLES)
        ],
    )
    yield "a retry's backoff", [clipped(60 + rng.expovariate(1 / 120)) for _ in range(SAMPLES)]
    yield (
        "wide, median 180 s",
        [clipped(rng.lognormvariate(math.log(180), 0.5)) for _ in range(SAMPLES)],
    )
    for median in (70, 100, 130, 200, 260, 330, 450, 600, 800):
        yield (
            f"narrow, median {median} s",
            [clipped(rng.lognormvariate(math.log(median), 0.3)) for _ in range(SAMPLES)],
        )


@pytest.mark.parametrize("q", [0.9, 0.99])
@pytest.mark.parametrize(("spread", "samples"), list(spreads()), ids=[n for n, _ in spreads()])
def test_p90_and_p99_from_the_buckets_are_within_10_percent_of_the_rows(
    q: float, spread: str, samples: list[float]
) -> None:
    estimate = histogram_quantile(q, DECISION_BUCKETS, samples)
    truth = exact(q, samples)

    assert abs(estimate - truth) / truth <= TOLERANCE, (spread, q, estimate, truth)


def test_the_estimator_is_prometheus_s_interpolation() -> None:
    # Ten observations in (0, 10], ten in (10, 20]: the median is the first bucket's top,
    # the 75th percentile halfway through the second.
    samples = [5.0] * 10 + [15.0] * 10

    assert histogram_quantile(0.5, (10.0, 20.0), samples) == 10.0
    assert histogram_quantile(0.75, (10.0, 20.0), samples) == 15.0
    assert histogram_quantile(0.99, (10.0,), [50.0] * 3) == 10.0
