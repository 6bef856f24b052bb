"""Faults of the database sessions and of the proxied links: every daemon's sessions
ended; a link slowed, silenced or reset."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg

from harness.diagnostics import terminate_backends
from harness.faults.registry import fault_kind
from harness.parameters import (
    APPLICATION_NAMES,
    LINK_BLACKHOLE_SECONDS,
    LINK_DELAY_PER_CHUNK_SECONDS,
    LINK_FAULT_SECONDS,
    LINKS,
)
from harness.proxy import ThreadedProxy

if TYPE_CHECKING:
    from harness.run import Chaos
    from harness.schedule import ScheduledFault


@fault_kind(
    "db_connection_kill",
    "database",
    lambda slot: "every daemon's sessions",
)
def _fault_db_connection_kill(chaos: Chaos, fault: ScheduledFault) -> bool:
    with psycopg.connect(chaos.database_url, autocommit=True) as connection:
        ended = terminate_backends(connection, list(APPLICATION_NAMES.values()))
    chaos.tally.db_connection_kills += ended
    return ended > 0


@fault_kind(
    "link_delay",
    "network",
    lambda slot: (
        f"{LINKS[slot % 2]} link +{LINK_DELAY_PER_CHUNK_SECONDS * 1000:g} ms a chunk "
        f"for {LINK_FAULT_SECONDS:g} s"
    ),
)
def _fault_link_delay(chaos: Chaos, fault: ScheduledFault) -> bool:
    if not _link_fault(
        chaos, fault, LINK_FAULT_SECONDS, lambda link: link.delay(LINK_DELAY_PER_CHUNK_SECONDS)
    ):
        return False
    chaos.tally.link_delays += 1
    return True


@fault_kind(
    "link_blackhole",
    "network",
    lambda slot: f"{LINKS[slot % 2]} link silent for {LINK_BLACKHOLE_SECONDS:g} s",
)
def _fault_link_blackhole(chaos: Chaos, fault: ScheduledFault) -> bool:
    if not _link_fault(chaos, fault, LINK_BLACKHOLE_SECONDS, ThreadedProxy.blackhole):
        return False
    chaos.tally.link_blackholes += 1
    return True


def _link_fault(
    chaos: Chaos, fault: ScheduledFault, seconds: float, start: Callable[[ThreadedProxy], None]
) -> bool:
    """Slow or silence one link for a while; one such fault per link at a time."""
    link = chaos.links[LINKS[fault.slot % 2]]
    if not chaos.lasting(f"link_{fault.slot % 2}", seconds, link.restore):
        return False
    start(link)
    return True


@fault_kind(
    "link_cut",
    "network",
    lambda slot: f"{LINKS[slot % 2]} link reset",
)
def _fault_link_cut(chaos: Chaos, fault: ScheduledFault) -> bool:
    cut = chaos.links[LINKS[fault.slot % 2]].cut()
    chaos.tally.link_cuts += cut > 0
    return cut > 0
