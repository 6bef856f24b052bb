"""Faults of the broker: restarted (stop_app, then start_app), and one daemon's
connections closed. Both call rabbitmqctl, off the stream's loop."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from harness.broker_control import start_app
from harness.daemons import Daemon
from harness.faults.registry import fault_kind
from harness.parameters import APPLICATION_NAMES, BROKER_DOWN_SECONDS, DAEMONS

if TYPE_CHECKING:
    from harness.run import Chaos
    from harness.schedule import ScheduledFault


@fault_kind(
    "broker_connection_close",
    "broker",
    lambda slot: f"{DAEMONS[slot]}#{slot % 2}",
    off_loop=True,
    needs_no_work=True,
)
def _fault_broker_connection_close(chaos: Chaos, fault: ScheduledFault) -> bool:
    if "broker_restart" in chaos.endings:
        return False  # nothing to close while the broker is down
    if chaos.hogs:
        return False  # rabbitmqctl's own VM starves beside the hogs: after them
    closed = _close_broker_connections(chaos, chaos.daemons[fault.slot])
    chaos.tally.broker_connection_closes += closed
    return closed > 0


@fault_kind(
    "broker_restart",
    "broker",
    lambda slot: f"stop_app, start_app {BROKER_DOWN_SECONDS:g} s later",
    off_loop=True,
)
def _fault_broker_restart(chaos: Chaos, fault: ScheduledFault) -> bool:
    control = chaos.broker_control
    assert control is not None
    if "broker_restart" in chaos.endings:
        return False
    if chaos.hogs:
        # Its start_app (an Erlang VM of its own) would starve beside the hogs and
        # leave the broker stopped: the two faults take turns.
        return False
    if control("stop_app") is None:
        return False
    chaos.lasting("broker_restart", BROKER_DOWN_SECONDS, lambda: start_app(control), off_loop=True)
    chaos.tally.broker_restarts += 1
    return True


def _close_broker_connections(chaos: Chaos, daemon: Daemon) -> int:
    """Close this daemon's own connections only, found by the connection name it
    gives (application name, host, pid): other work shares the broker."""
    control = chaos.broker_control
    assert control is not None
    marker = f"{APPLICATION_NAMES[daemon.kind]} {socket.gethostname()}:{daemon.pid}:"
    listing = control(
        "list_connections",
        "-q",
        "--no-table-headers",
        "pid",
        "client_properties",
    )
    closed = 0
    for line in (listing or "").splitlines():
        pid, _, properties = line.partition("\t")
        if marker in properties:
            control("close_connection", pid.strip(), "outbox chaos")
            closed += 1
    if not closed:
        chaos.tally.faults_that_found_nothing += 1
    return closed
