"""Overload (#22): CPU hogs, a slow database link, a burst of decisions."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from harness.faults.registry import fault_kind
from harness.parameters import (
    BURST_FACTOR,
    BURST_SHARE,
    CPU_HOGS_PER_CORE,
    LINKS,
    OVERLOAD_SECONDS,
    SLOW_DATABASE_SECONDS,
)

if TYPE_CHECKING:
    from harness.run import Chaos
    from harness.schedule import ScheduledFault


@fault_kind(
    "cpu_starvation",
    "overload",
    lambda slot: f"{CPU_HOGS_PER_CORE[slot % 2]} busy loops a core for {OVERLOAD_SECONDS:g} s",
)
def _fault_cpu_starvation(chaos: Chaos, fault: ScheduledFault) -> bool:
    """Busy loops at normal priority, 2x or 4x the cores this process may use: the
    daemons, Postgres and this harness all get a share of what is left."""
    if chaos.hogs or "broker_restart" in chaos.endings or chaos.off_loop.busy():
        return False  # one at a time; a broker's CLI calls (start_app above all) first
    count = CPU_HOGS_PER_CORE[fault.slot % 2] * len(os.sched_getaffinity(0))
    chaos.hogs = [
        # This interpreter, a loop of its own: nothing of the caller's reaches it.
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]
    chaos.lasting("cpu_starvation", OVERLOAD_SECONDS, functools.partial(_end_cpu_starvation, chaos))
    chaos.tally.cpu_starvations += 1
    return True


def _end_cpu_starvation(chaos: Chaos) -> None:
    hogs, chaos.hogs = chaos.hogs, []
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()
    chaos.overload_over()


@fault_kind(
    "slow_database",
    "overload",
    lambda slot: (
        f"database link +{SLOW_DATABASE_SECONDS[0] * 1000:g}-"
        f"{SLOW_DATABASE_SECONDS[1] * 1000:g} ms a chunk for {OVERLOAD_SECONDS:g} s"
    ),
)
def _fault_slow_database(chaos: Chaos, fault: ScheduledFault) -> bool:
    """The proxied daemons' database link: every chunk 50-500 ms late, both ways."""
    link = chaos.links["database"]

    def end() -> None:
        link.restore()
        chaos.overload_over()

    # The database link's slot: one link fault at a time on it (link_delay's too).
    if not chaos.lasting(f"link_{LINKS.index('database')}", OVERLOAD_SECONDS, end):
        return False
    link.delay(SLOW_DATABASE_SECONDS[0], up_to=SLOW_DATABASE_SECONDS[1])
    chaos.tally.slow_databases += 1
    return True


@fault_kind(
    "decision_burst",
    "overload",
    lambda slot: (
        f"decisions at {BURST_FACTOR:g}x the measured drain rate (its "
        f"share of the {BURST_SHARE:.0%} kept for bursts)"
    ),
)
def _fault_decision_burst(chaos: Chaos, fault: ScheduledFault) -> bool:
    """Decisions at 3x the drain rate measured when quiet, on top of the stream's:
    this burst's share of the decisions the steady stream left to the bursts."""
    if chaos.burst is not None:
        return False
    drain_rate = chaos.quiet_rate if chaos.quiet_rate else chaos.rate
    burst_rate = BURST_FACTOR * drain_rate
    chaos.burst = (time.monotonic(), burst_rate, chaos.burst_recorded)
    before = chaos.burst_recorded

    def end() -> None:
        chaos.burst_recorded = before + chaos.burst_size
        chaos.burst = None
        chaos.overload_over()

    chaos.lasting("decision_burst", chaos.burst_size / burst_rate, end)
    chaos.tally.decision_bursts += 1
    return True
