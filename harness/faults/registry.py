"""Every kind of fault a chaos run injects, registered where its handler is written."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.run import Chaos
    from harness.schedule import ScheduledFault

# How a run injects a fault: False if it found nothing to act on (try again later).
Injector = Callable[["Chaos", "ScheduledFault"], bool]


@dataclass(frozen=True)
class Fault:
    """One kind of fault: the category ``--faults`` enables it by, what it targets given
    its slot (the schedule and the run's lines print it), and how a run injects it.

    ``off_loop``: its calls start a CLI's Erlang VM (rabbitmqctl), which a busy machine
    may take a minute to boot. Such a fault runs on the broker-control thread, so the
    stream's loop keeps recording decisions and ending other faults on time meanwhile (a
    sweep beside fsync-heavy writers once saw one call hold the loop for 61.6 s: an
    overload due to end after 10 s lasted 70, and eight faults then landed at once).

    ``needs_no_work``: what it acts on (a daemon's broker connection) does not depend on
    decisions in flight, so it keeps its tries past the stream's last decision instead of
    giving up :data:`FAULT_RETRY_AFTER_STREAM_SECONDS` after it."""

    category: str
    target: Callable[[int], str]
    inject: Injector
    off_loop: bool = False
    needs_no_work: bool = False


# Every kind of fault: each ``_fault_*`` function of a module of ``harness.faults``
# registers itself with ``@fault_kind`` (below), so a kind, its description and its
# handler are written once, side by side. FAULT_CATEGORIES (``harness/faults/__init__.py``)
# is derived from it, in the order the schedule draws from.
FAULTS: dict[str, Fault] = {}


def fault_kind(
    kind: str,
    category: str,
    target: Callable[[int], str],
    *,
    off_loop: bool = False,
    needs_no_work: bool = False,
) -> Callable[[Injector], Injector]:
    def register(inject: Injector) -> Injector:
        if kind in FAULTS:
            raise ValueError(f"fault {kind} registered twice")
        FAULTS[kind] = Fault(category, target, inject, off_loop, needs_no_work)
        return inject

    return register
