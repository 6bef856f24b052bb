"""Faults of the callbacks (#25): the webhooks flow all run long; these disturb them for
a while (dropped, forged or stale, duplicated and reordered, delayed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.faults.provider import provider_window
from harness.faults.registry import fault_kind
from harness.parameters import (
    PROVIDER_FAULT_SECONDS,
    WEBHOOK_DELAY_MS,
    WEBHOOK_DROP_EVERY,
    WEBHOOK_DUPLICATE_EVERY,
    WEBHOOK_FORGE_EVERY,
    WEBHOOK_REORDER,
    WEBHOOK_STALE_EVERY,
)

if TYPE_CHECKING:
    from harness.run import Chaos
    from harness.schedule import ScheduledFault


@fault_kind(
    "webhooks_dropped",
    "callbacks",
    lambda slot: f"every {WEBHOOK_DROP_EVERY}nd webhook dropped for {PROVIDER_FAULT_SECONDS:g} s",
)
def _fault_webhooks_dropped(chaos: Chaos, fault: ScheduledFault) -> bool:
    return provider_window(
        chaos,
        "webhooks_dropped",
        {"webhook_drop_every": WEBHOOK_DROP_EVERY},
        "webhook_drop_windows",
    )


@fault_kind(
    "webhooks_forged",
    "callbacks",
    lambda slot: (
        f"every {WEBHOOK_FORGE_EVERY}nd webhook forged, every "
        f"{WEBHOOK_STALE_EVERY}rd stale, for {PROVIDER_FAULT_SECONDS:g} s"
    ),
)
def _fault_webhooks_forged(chaos: Chaos, fault: ScheduledFault) -> bool:
    return provider_window(
        chaos,
        "webhooks_forged",
        {
            "webhook_forge_every": WEBHOOK_FORGE_EVERY,
            "webhook_stale_every": WEBHOOK_STALE_EVERY,
        },
        "webhook_forge_windows",
    )


@fault_kind(
    "webhooks_duplicated",
    "callbacks",
    lambda slot: (
        f"every {WEBHOOK_DUPLICATE_EVERY}nd webhook twice, "
        f"{WEBHOOK_REORDER} at a time newest first, for {PROVIDER_FAULT_SECONDS:g} s"
    ),
)
def _fault_webhooks_duplicated(chaos: Chaos, fault: ScheduledFault) -> bool:
    return provider_window(
        chaos,
        "webhooks_duplicated",
        {
            "webhook_duplicate_every": WEBHOOK_DUPLICATE_EVERY,
            "webhook_reorder": WEBHOOK_REORDER,
        },
        "webhook_duplicate_windows",
    )


@fault_kind(
    "webhooks_delayed",
    "callbacks",
    lambda slot: f"webhooks held {WEBHOOK_DELAY_MS} ms for {PROVIDER_FAULT_SECONDS:g} s",
)
def _fault_webhooks_delayed(chaos: Chaos, fault: ScheduledFault) -> bool:
    return provider_window(
        chaos, "webhooks_delayed", {"webhook_delay_ms": WEBHOOK_DELAY_MS}, "webhook_delay_windows"
    )
