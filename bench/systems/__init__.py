"""The systems bench/e2e.py compares, each one class on the ``System`` protocol.

A system sets up its own database (and broker names), writes decisions as its users
would (a backlog in one transaction for the drain, one per transaction for the latency
writer), names the daemons that drain it with the CPU group of each, reads back when
each effect happened, checks what it must, and tears down. The driver (bench/e2e.py)
knows nothing else about any of them.
"""

from __future__ import annotations

from bench.systems.base import CHILD_MODULE, READY, Context, Daemon, System, ready_marker
from bench.systems.effect_outbox import Outbox, OutboxInTransaction, OutboxSettings, SingleOutbox
from bench.systems.minimal import MINIMAL_BATCH, MINIMAL_PREFETCH, Minimal
from bench.systems.peers import Pgqueuer, Procrastinate

__all__ = [
    "CHILD_MODULE",
    "MINIMAL_BATCH",
    "MINIMAL_PREFETCH",
    "READY",
    "SYSTEM_NAMES",
    "Context",
    "Daemon",
    "OutboxSettings",
    "System",
    "ready_marker",
    "systems",
]


SYSTEM_NAMES = (
    "minimal",
    "outbox",
    "outbox-single",
    "outbox-in-transaction",
    "pgqueuer",
    "procrastinate",
)


def systems(context: Context, outbox: OutboxSettings | None = None) -> dict[str, System]:
    """Every system, by name, in the order the comparison runs them."""
    found: dict[str, System] = {
        "minimal": Minimal(context),
        "outbox": Outbox(context, outbox or OutboxSettings()),
        "outbox-single": SingleOutbox(context, outbox or OutboxSettings()),
        "outbox-in-transaction": OutboxInTransaction(context, outbox or OutboxSettings()),
        "pgqueuer": Pgqueuer(context),
        "procrastinate": Procrastinate(context),
    }
    assert tuple(found) == SYSTEM_NAMES
    return found
