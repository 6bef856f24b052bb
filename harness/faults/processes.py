"""Faults of the daemons' processes: killed (one while the provider holds a refund it
has committed), and a consumer paused past its lease."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import psycopg

from harness.daemons import Daemon
from harness.faults.registry import fault_kind
from harness.parameters import HOLD_RESPONSE_MS, HOLD_WAIT_SECONDS, LOOP_SECONDS, STOP_SECONDS
from outbox import store
from outbox.store import Store

if TYPE_CHECKING:
    from harness.run import Chaos
    from harness.schedule import ScheduledFault


@fault_kind(
    "dispatcher_kill",
    "process",
    lambda slot: f"dispatcher#{slot}",
)
def _fault_dispatcher_kill(chaos: Chaos, fault: ScheduledFault) -> bool:
    chaos.of_kind("dispatcher")[fault.slot].kill_and_restart()
    chaos.tally.dispatcher_kills += 1
    return True


@fault_kind(
    "consumer_kill",
    "process",
    lambda slot: f"consumer#{slot}",
)
def _fault_consumer_kill(chaos: Chaos, fault: ScheduledFault) -> bool:
    chaos.of_kind("consumer")[fault.slot].kill_and_restart()
    chaos.tally.consumer_kills += 1
    return True


@fault_kind(
    "consumer_kill_in_effect",
    "process",
    lambda slot: "the consumer whose refund the provider holds",
)
def _fault_consumer_kill_in_effect(chaos: Chaos, fault: ScheduledFault) -> bool:
    """SIGKILL the consumer whose refund the provider has committed but not answered:
    the effect exists, its outcome record never will."""
    if "lookups_unavailable" in chaos.endings or "provider_outage" in chaos.endings:
        return False  # keep the provider's faults apart: one window at a time
    chaos.provider.set_faults(delay_ms=HOLD_RESPONSE_MS)
    try:
        victim = _holder_of_a_committed_refund(chaos, time.monotonic() + HOLD_WAIT_SECONDS)
        if victim is None:
            return False
        victim.kill_and_restart()
    finally:
        chaos.provider.set_faults(delay_ms=0)  # releases the held responses
    chaos.tally.consumer_kills += 1
    chaos.tally.consumer_kills_in_effect += 1
    return True


def _holder_of_a_committed_refund(chaos: Chaos, deadline: float) -> Daemon | None:
    consumers = {daemon.pid: daemon for daemon in chaos.of_kind("consumer")}
    with psycopg.connect(chaos.database_url) as connection:
        runner = Store(connection)
        while time.monotonic() < deadline:
            for key in chaos.provider.executing_keys():
                try:
                    operation = runner.run(store.find_operation(uuid.UUID(key)))
                except ValueError:
                    continue
                owner = operation.lease_owner if operation is not None else None
                # lease owner: host:pid:instance (consumer/worker.py)
                pid = owner.split(":")[-2] if owner and owner.count(":") >= 2 else ""
                if pid.isdigit() and int(pid) in consumers:
                    return consumers[int(pid)]
            time.sleep(LOOP_SECONDS / 2)  # polling the provider, with the deadline above
    return None


@fault_kind(
    "consumer_stop",
    "process",
    lambda slot: f"consumer#{slot} for {STOP_SECONDS:g} s",
)
def _fault_consumer_stop(chaos: Chaos, fault: ScheduledFault) -> bool:
    consumers = chaos.of_kind("consumer")
    # Never both at once: the point is a zombie waking beside a live worker.
    if any(c.stopped_until is not None for c in consumers):
        return False
    consumers[fault.slot].pause(time.monotonic() + STOP_SECONDS)
    chaos.tally.consumer_stops += 1
    return True
