"""Faults of the provider, each for a while: conflicts, lookups unavailable, the whole
provider down, rate limits, idempotency keys forgotten. Besides these the sandbox drops
responses and fails before committing throughout the run."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from harness.faults.registry import fault_kind
from harness.parameters import (
    PROVIDER_CONFLICT_PROBABILITY,
    PROVIDER_FAULT_SECONDS,
    PROVIDER_OUTAGE_SECONDS,
    PRUNE_KEYS_OLDER_THAN_SECONDS,
    RATE_LIMIT_EVERY,
    RATE_LIMIT_RETRY_AFTER_SECONDS,
)

if TYPE_CHECKING:
    from harness.run import Chaos
    from harness.schedule import ScheduledFault


@fault_kind(
    "provider_conflicts",
    "provider",
    lambda slot: (
        f"409 to {PROVIDER_CONFLICT_PROBABILITY:.0%} of refunds for {PROVIDER_FAULT_SECONDS:g} s"
    ),
)
def _fault_provider_conflicts(chaos: Chaos, fault: ScheduledFault) -> bool:
    return provider_window(
        chaos,
        "provider_conflicts",
        {"conflict_probability": PROVIDER_CONFLICT_PROBABILITY},
        "provider_conflict_windows",
    )


@fault_kind(
    "lookups_unavailable",
    "provider",
    lambda slot: f"503 to lookups for {PROVIDER_FAULT_SECONDS:g} s",
)
def _fault_lookups_unavailable(chaos: Chaos, fault: ScheduledFault) -> bool:
    return provider_window(
        chaos, "lookups_unavailable", {"lookups_unavailable": True}, "lookup_outages", outage=True
    )


@fault_kind(
    "provider_outage",
    "provider",
    lambda slot: "503 to every call and lookup",
)
def _fault_provider_outage(chaos: Chaos, fault: ScheduledFault) -> bool:
    """The provider down (#44): every refund, email and lookup answered 503 and
    nothing done. Refunds must wait for it, spending no attempt and no lookup, and
    go to a person only once it has outlasted their tolerance."""
    seconds = fault.seconds or PROVIDER_OUTAGE_SECONDS[fault.slot % len(PROVIDER_OUTAGE_SECONDS)]

    def back() -> None:
        chaos.provider_back = time.monotonic()

    return provider_window(
        chaos,
        "provider_outage",
        {"unavailable": True},
        "provider_outages",
        seconds=seconds,
        outage=True,
        then=back,
    )


@fault_kind(
    "provider_rate_limit",
    "provider",
    lambda slot: (
        f"429 with Retry-After: {RATE_LIMIT_RETRY_AFTER_SECONDS} to every "
        f"{RATE_LIMIT_EVERY}nd call and lookup for {PROVIDER_FAULT_SECONDS:g} s"
    ),
)
def _fault_provider_rate_limit(chaos: Chaos, fault: ScheduledFault) -> bool:
    return provider_window(
        chaos,
        "provider_rate_limit",
        {
            "rate_limit_every": RATE_LIMIT_EVERY,
            "rate_limit_retry_after_s": RATE_LIMIT_RETRY_AFTER_SECONDS,
        },
        "rate_limit_windows",
    )


@fault_kind(
    "keys_pruned",
    "provider",
    lambda slot: (
        f"keys older than {PRUNE_KEYS_OLDER_THAN_SECONDS:g} s forgotten "
        f"for {PROVIDER_FAULT_SECONDS:g} s"
    ),
)
def _fault_keys_pruned(chaos: Chaos, fault: ScheduledFault) -> bool:
    return provider_window(
        chaos,
        "keys_pruned",
        {"prune_keys_older_than_s": PRUNE_KEYS_OLDER_THAN_SECONDS},
        "key_prunings",
    )


def provider_window(
    chaos: Chaos,
    kind: str,
    fault_fields: dict[str, Any],
    counter: str,
    *,
    seconds: float = PROVIDER_FAULT_SECONDS,
    outage: bool = False,
    then: Callable[[], None] | None = None,
) -> bool:
    """Turn provider faults on for ``seconds``; an ``outage`` (the provider or its
    lookups down) is kept in :attr:`Chaos.outage_spans` for the checker."""
    base = chaos.provider.faults
    normal = {name: getattr(base, name) for name in fault_fields}
    provider = chaos.provider
    started = time.monotonic()

    def end() -> None:
        provider.set_faults(**normal)
        if outage:
            chaos.outage_spans.append((started, time.monotonic()))
        if then is not None:
            then()

    if not chaos.lasting(kind, seconds, end):
        return False
    chaos.provider.set_faults(**fault_fields)
    setattr(chaos.tally, counter, getattr(chaos.tally, counter) + 1)
    return True
