"""The chaos run's schedule: which faults come when, drawn from the seed alone, and the
stream of decisions they land on; how long a run may take."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from harness.faults import FAULT_CATEGORIES, FAULTS
from harness.parameters import (
    DAEMONS,
    EMAIL_EVERY,
    FAULT_SPACING_SECONDS,
    MAX_AMOUNT_CENTS,
    MIN_STREAM_SECONDS,
    PROVIDER_OUTAGE_SECONDS,
    QUIET_SECONDS,
    RUN_OVERHEAD_SECONDS,
    STREAM_SECONDS_PER_OPERATION,
    liveness_bound,
)


@dataclass(frozen=True)
class ScheduledFault:
    at: float  # seconds after the first decision
    kind: str
    slot: int  # which of the two daemons of the kind the fault targets
    seconds: float | None = None  # how long it lasts, where the schedule draws that

    def describe(self) -> str:
        return f"t=+{self.at:5.1f}s {self.kind:<24} {self.target()}"

    def target(self) -> str:
        what = FAULTS[self.kind].target(self.slot)
        return what if self.seconds is None else f"{what} for {self.seconds:g} s"


def stream_seconds(operations: int) -> float:
    return max(MIN_STREAM_SECONDS, operations * STREAM_SECONDS_PER_OPERATION)


# Once a run, never among the extra faults: an outage's length is the point of it, and a
# second one would only add minutes to the run.
ONCE_A_RUN = frozenset({"provider_outage"})


def fault_schedule(
    seed: int,
    operations: int,
    categories: frozenset[str],
    *,
    outage_seconds: float | None = None,
) -> list[ScheduledFault]:
    """The faults, in time order: at least one of every enabled kind whatever the seed,
    then more of random kinds as the stream gets longer. Only ``seed`` and the
    arguments decide it, so a run can be repeated. A provider outage lasts one of
    :data:`PROVIDER_OUTAGE_SECONDS`, drawn from the seed, or ``outage_seconds``."""
    # Not for security: a reproducible schedule is the point of the seed.
    rng = random.Random(seed)  # noqa: S311
    kinds = [kind for category in sorted(categories) for kind in FAULT_CATEGORIES[category]]
    if not kinds:
        return []
    duration = stream_seconds(operations)
    extra = max(0, int(duration // FAULT_SPACING_SECONDS) - len(kinds))
    repeatable = [kind for kind in kinds if kind not in ONCE_A_RUN]
    chosen = kinds + [rng.choice(repeatable) for _ in range(extra) if repeatable]
    rng.shuffle(chosen)
    _outage_after_the_kills_in_effect(chosen)
    # Recovery from overload is judged against the quiet rate: measured first.
    first = QUIET_SECONDS if "overload" in categories else 1.0
    times = sorted(rng.uniform(first, duration) for _ in chosen)
    schedule = []
    for at, kind in zip(times, chosen, strict=True):
        seconds = None
        if kind == "broker_connection_close":
            # any of the four daemons; the others one of two of a kind
            slot = rng.randrange(len(DAEMONS))
        elif kind == "provider_outage":
            slot = rng.randrange(len(PROVIDER_OUTAGE_SECONDS))
            seconds = PROVIDER_OUTAGE_SECONDS[slot] if outage_seconds is None else outage_seconds
        else:
            slot = rng.randrange(2)
        schedule.append(ScheduledFault(round(at, 1), kind, slot, seconds))
    return schedule


def _outage_after_the_kills_in_effect(chosen: list[str]) -> None:
    """Move the outage behind every kill in effect (``chosen`` is in time order): no
    refund is in the provider's hands while it is down, and after a long one nothing may
    be left to hold, so a kill due during it would find nothing at all."""
    if "provider_outage" not in chosen:
        return
    outage = chosen.index("provider_outage")
    kills = [n for n, kind in enumerate(chosen) if kind == "consumer_kill_in_effect"]
    if kills and kills[-1] > outage:
        chosen[outage], chosen[kills[-1]] = chosen[kills[-1]], chosen[outage]


def decision(n: int) -> tuple[str, dict[str, Any]]:
    """The n-th decision of the stream: every EMAIL_EVERY-th an email, the rest refunds."""
    if n % EMAIL_EVERY == EMAIL_EVERY - 1:
        return "send_email", {
            "to": f"customer{n}@example.com",
            "subject": f"About your order {n}",
            "body": "Your refund is on its way.",
        }
    return "send_refund", {
        "payment_id": f"pay_chaos_{n}",
        "amount_cents": 100 + (n * 7919) % (MAX_AMOUNT_CENTS - 100),
    }


def run_deadline(operations: int, outage_seconds: float = max(PROVIDER_OUTAGE_SECONDS)) -> float:
    """The longest one run of ``operations`` decisions may take, start to exit: what a
    caller (a test, a CI job) waits before it stops the run with SIGTERM. A provider
    outage of ``outage_seconds`` (the longest the schedule draws) may begin as the
    stream ends, and the liveness bound counts from its end."""
    return stream_seconds(operations) + outage_seconds + liveness_bound() + RUN_OVERHEAD_SECONDS
