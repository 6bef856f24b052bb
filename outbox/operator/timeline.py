"""An operation's timeline a page at a time, as ``outbox ops show`` and the console read
it: the cursor a flag or a link carries, and the words and JSON that say where a page
lies in its timeline.

Daemons may append any number of events to one operation (a long outage's lookups, a
flood of callbacks), so no front end reads a timeline whole. A page is at most
``store.MAX_EVENTS_PAGE`` events, oldest first within the page; without a cursor it is
the newest ones, because the newest events say why the operation stands where it does,
and its birth (tool, input, time) is in the operation's own facts above the timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from outbox.models import OperationEvent
from outbox.store import EventsPage

# Events per page when the reader names no size: every timeline of an ordinary
# operation fits, and one with thousands costs a page.
DEFAULT_EVENTS = 100
# A bigint identity, and one less: the store reads "before the end" as the largest.
_LARGEST_CURSOR = (1 << 63) - 2
_MOST_DIGITS = len(str(_LARGEST_CURSOR))


def event_cursor(text: str) -> int:
    """The event id a page link or ``--after``/``--before`` names (0: before the first
    event); ValueError, saying what a cursor looks like, for anything else."""
    given = text.strip()
    if (
        not given
        or len(given) > _MOST_DIGITS
        or not (given.isascii() and given.isdigit())
        or int(given) > _LARGEST_CURSOR
    ):
        raise ValueError(
            "not an event id: a cursor is the whole number a timeline page's link or "
            "hint gives (0 for the oldest events)"
        )
    return int(given)


def heading(page: EventsPage) -> str:
    """How many events the timeline holds and which of them the page shows."""
    if not page.earlier and not page.later:
        return f"{page.total} events"
    if not page.events:
        return f"none of {page.total} events on this page"
    first = page.earlier + 1
    return f"events {first}-{first + len(page.events) - 1} of {page.total}"


def earlier_hint(command: str, page: EventsPage) -> str | None:
    """The command that shows the events before this page (None: there are none)."""
    if page.previous is None:
        return None
    return (
        f"{page.earlier} earlier event(s): {command} --before {page.previous} "
        f"(from the first: --after 0)"
    )


def later_hint(command: str, page: EventsPage) -> str | None:
    """The command that shows the events after this page (None: there are none)."""
    if page.next is None:
        return None
    return f"{page.later} later event(s): {command} --after {page.next}"


def page_json(
    page: EventsPage, event_json: Callable[[OperationEvent], dict[str, Any]]
) -> dict[str, Any]:
    """The page's events as ``event_json`` renders each, and the cursors to walk on:
    ``next`` for ``--after``, ``previous`` for ``--before`` (null at either end)."""
    return {
        "events": [event_json(event) for event in page.events],
        "events_total": page.total,
        "next": page.next,
        "previous": page.previous,
    }
