"""The operator console's reads (``outbox console``): operations a page at a time, an
operation's timeline a page at a time (``outbox ops show`` reads it the same way), and
the approval decisions of one operation.

Pages are cut with a keyset, never with OFFSET: operations on ``(updated_at, id)``,
events on their id. The next page starts strictly after the last row shown, so reading
page 500 costs what page 1 does, and a row that changes between two pages moves to the
top instead of shifting every later page by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from uuid import UUID

from outbox.models import Approval, OperationEvent
from outbox.states import OperationState
from outbox.store.operator import OperationSummary, tool_listing_limits
from outbox.store.runner import Plan, Row, Step


@dataclass(frozen=True)
class Cursor:
    """Where a page ends: the last row's last change and id."""

    updated_at: datetime
    id: UUID


@dataclass(frozen=True)
class OperationFilter:
    states: tuple[OperationState, ...] = ()
    tool: str | None = None
    run_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True)
class OperationPage:
    rows: list[OperationSummary]
    next: Cursor | None
    """Where the following page starts; None on the last page."""


def operations_page(
    where: OperationFilter, *, after: Cursor | None = None, limit: int = 50
) -> Plan[OperationPage]:
    """Up to ``limit`` operations after ``after``, newest change first; never the input."""
    if limit < 1:
        raise ValueError("a page holds at least one operation")
    params = {
        "states": [str(s) for s in where.states] or None,
        "tool": where.tool,
        "run_id": where.run_id,
        "since": where.since,
        "until": where.until,
        "after_updated_at": after.updated_at if after else None,
        "after_id": after.id if after else None,
        # One row more than shown says whether a next page exists, without a count.
        "limit": limit + 1,
    }
    if where.tool is None:
        rows = yield Step("console_operations_page", params)
    else:
        limits = tool_listing_limits(where.states, limit + 1)
        rows = yield Step("console_tool_operations_page", params | limits)
    summaries = [OperationSummary.from_row(row) for row in rows[:limit]]
    more = len(rows) > limit
    last = summaries[-1] if summaries else None
    return OperationPage(
        rows=summaries,
        next=Cursor(updated_at=last.updated_at, id=last.id) if more and last else None,
    )


# The most events one read returns. Daemons may append any number of events to an
# operation (a long outage's probes), so no reader may ask for the whole timeline at once.
MAX_EVENTS_PAGE = 500
_NO_EVENT = 0
_PAST_EVERY_EVENT = (1 << 63) - 1


@dataclass(frozen=True)
class EventsPage:
    """Consecutive events of one operation's timeline, oldest first, and how many of the
    timeline's events lie on either side of them."""

    events: list[OperationEvent]
    earlier: int
    """Events of the timeline older than this page."""
    later: int
    """Events of the timeline newer than this page."""
    next: int | None
    """The ``after_id`` of the page that follows; None when no event is newer."""
    previous: int | None
    """The ``before_id`` of the page that precedes; None when no event is older."""

    @property
    def total(self) -> int:
        """Every event of the timeline, as this page's snapshot counted them."""
        return self.earlier + len(self.events) + self.later


def events_page(
    operation_id: UUID,
    *,
    after_id: int | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> Plan[EventsPage]:
    """At most ``limit`` (up to :data:`MAX_EVENTS_PAGE`) events of one operation: the
    oldest after event ``after_id`` (0: from the first), or the newest before event
    ``before_id``; with neither, the newest ``limit``. Following ``next`` from
    ``after_id=0``, or ``previous`` from the newest page, reads every event once, in
    order."""
    rows = yield Step("list_events_page", page_parameters(operation_id, after_id, before_id, limit))
    return page_of_events(rows)


def page_parameters(
    operation_id: UUID, after_id: int | None, before_id: int | None, limit: int
) -> dict[str, object]:
    """The parameters of a page of events (list_events_page, history_events_page); a
    size or a cursor out of bounds is a ValueError."""
    if not 1 <= limit <= MAX_EVENTS_PAGE:
        raise ValueError(f"a page of events holds 1 to {MAX_EVENTS_PAGE} events, not {limit}")
    if after_id is not None and before_id is not None:
        raise ValueError("a page of events starts after one event or ends before one, not both")
    for cursor in (after_id, before_id):
        if cursor is not None and not _NO_EVENT <= cursor < _PAST_EVERY_EVENT:
            raise ValueError(f"not an event id: {cursor}")
    return {
        "operation_id": operation_id,
        "forward": after_id is not None,
        "after": _NO_EVENT if after_id is None else after_id,
        "before": _PAST_EVERY_EVENT if before_id is None else before_id,
        "limit": limit,
    }


def page_of_events(rows: list[Row]) -> EventsPage:
    """A page of events from the rows of list_events_page or history_events_page."""
    counts = rows[0]
    return EventsPage(
        events=[OperationEvent.model_validate(row) for row in rows if row["id"] is not None],
        earlier=int(counts["earlier"]),
        later=int(counts["later"]),
        next=int(counts["hi"]) if counts["later"] else None,
        previous=int(counts["lo"]) if counts["earlier"] else None,
    )


def operation_approvals(operation_id: UUID) -> Plan[list[Approval]]:
    """Every grant and denial of one operation, newest first."""
    rows = yield Step("console_operation_approvals", {"operation_id": operation_id})
    return [Approval.model_validate(row) for row in rows]


@dataclass(frozen=True)
class ConsoleLogin:
    login: str
    operator: bool
    """A member of outbox_operator (a superuser is a member of every role)."""
    superuser: bool


def console_login() -> Plan[ConsoleLogin]:
    """Who the console's database login is, as the roles see it."""
    rows = yield Step("console_login", {})
    row = rows[0]
    return ConsoleLogin(
        login=row["login"], operator=bool(row["operator"]), superuser=bool(row["superuser"])
    )


class PreparedWait(StrEnum):
    """What a prepared operation waits for: the first that applies, in this order."""

    APPROVAL = "approval"
    """A person's grant: it needs one and its latest decision is none valid for its
    intent (missing, denied, expired, or for another intent)."""
    PROVIDER = "provider"
    """Its provider, which could not be reached: it spends no attempt meanwhile."""
    UNPUBLISHED = "unpublished"
    """The dispatcher: its outbox row is not published yet."""
    SCHEDULED = "scheduled"
    """The time of its next attempt (a retry's backoff)."""
    READY = "ready"
    """A consumer to claim it: due, published, nothing else holds it back."""


@dataclass(frozen=True)
class PreparedWaits:
    """The prepared operations by what they wait for, with the oldest of each."""

    counts: dict[PreparedWait, int] = field(default_factory=dict)
    oldest: dict[PreparedWait, tuple[UUID, float]] = field(default_factory=dict)
    """Per kind, the operation due longest and for how many seconds it has been due."""

    def count(self, kind: PreparedWait) -> int:
        return self.counts.get(kind, 0)


def prepared_waits() -> Plan[PreparedWaits]:
    """What every prepared operation waits for, counted, in one statement."""
    rows = yield Step("console_prepared_waits", {})
    waits = PreparedWaits()
    for row in rows:
        kind = PreparedWait(row["waits_for"])
        waits.counts[kind] = int(row["operations"])
        waits.oldest[kind] = (row["oldest_id"], float(row["oldest_due_seconds"]))
    return waits
