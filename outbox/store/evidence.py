"""The evidence chain: checking that an operation's lifecycle events are the ones that
were written, and that they support the row.

Every event carries a hash over a canonical form of itself and of the event before it
in its operation, and each operation's head (how many events, the last hash) is kept
apart; a trigger in ``schema.sql`` writes both in the statement that appends the event.
:func:`verify_chain` recomputes them in the database, with the function the trigger
uses, so there is one definition of the canonical form. What a broken link means, and
what no chain can show, is in docs/operating.md ("The evidence chain").
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from outbox.store.runner import Plan, Row, Step

# Operations per statement when checking all of them: each page is read and judged in
# the database, and only one row per operation (its count and its broken links) comes
# back, so memory stays flat however many events the table holds.
VERIFY_PAGE_SIZE = 1000

_FIRST_UUID = UUID(int=0)
_LAST_UUID = UUID(int=(1 << 128) - 1)

# What each reason a link can break for means, in words a person on call can act on
# (`outbox ops verify`, the console's operation page).
REASONS = {
    "hash_mismatch": "the event was changed after it was written",
    "prev_mismatch": "the event does not follow the one before it: an event was deleted "
    "or rewritten before it",
    "missing_tail": "the newest event(s) of the operation were deleted",
    "anchor_mismatch": "the chain's head does not name this last event: events or the head "
    "were written around the chain trigger",
    "missing_birth": "the operation has no operation.prepared event first: it was written "
    "around the statement that records decisions",
    "state_mismatch": "the operation's state is not the one its last transition event "
    "entered: the row was moved around the statements that record each move",
}


@dataclass(frozen=True)
class BrokenLink:
    """One place where the evidence disagrees with its chain.

    ``reason`` is one of:

    - ``hash_mismatch``: the event's content (name, attributes, time, ids, position or
      previous hash) is not what its hash was computed over: it was changed.
    - ``prev_mismatch``: the event does not follow the one before it in the chain (an
      event before it was deleted or rewritten, or it was moved).
    - ``missing_tail``: the operation's head counts more events than are left: its
      newest events were deleted (``event_id`` is None).
    - ``anchor_mismatch``: the head names another last event, or there is no head:
      events were added, or the head rewritten, without the chain trigger.
    - ``missing_birth``: the operation's first event is not its ``operation.prepared``
      (``event_id`` names that first event), or it has no event at all (None).
    - ``state_mismatch``: the row's state is not the one the last event that moved it
      entered (``event_id`` names that event): the row was changed without its event.
    """

    operation_id: UUID
    event_id: int | None
    reason: str


@dataclass(frozen=True)
class ChainReport:
    """What a check found: how many operations and events it read, and every broken
    link among them (none: the evidence is as the chain trigger wrote it)."""

    operations_checked: int
    events_checked: int
    broken: tuple[BrokenLink, ...]

    @property
    def intact(self) -> bool:
        return not self.broken


def verify_chain(operation_id: UUID | None = None) -> Plan[ChainReport]:
    """Check one operation's evidence chain, or every operation's when
    ``operation_id`` is None (page by page, in id order). An operation that does not
    exist is simply not counted: ``operations_checked`` is then 0.

    The pages of a full check are separate statements: in the caller's transaction they
    all see one snapshot only if it is REPEATABLE READ. Events appended meanwhile are
    not a risk either way: each page reads an operation's events and head together.
    """
    if operation_id is not None:
        rows = yield Step(
            "verify_event_chains", {"first": operation_id, "last": operation_id, "limit": 1}
        )
        return _report(rows, ChainReport(0, 0, ()))
    report = ChainReport(0, 0, ())
    first = _FIRST_UUID
    while True:
        rows = yield Step(
            "verify_event_chains",
            {"first": first, "last": _LAST_UUID, "limit": VERIFY_PAGE_SIZE},
        )
        report = _report(rows, report)
        last: UUID = rows[-1]["operation_id"] if rows else _LAST_UUID
        if len(rows) < VERIFY_PAGE_SIZE or last == _LAST_UUID:
            return report
        first = UUID(int=last.int + 1)


def _report(rows: list[Row], so_far: ChainReport) -> ChainReport:
    broken = [
        BrokenLink(
            operation_id=row["operation_id"], event_id=link["event_id"], reason=link["reason"]
        )
        for row in rows
        for link in row["broken"]
    ]
    return ChainReport(
        operations_checked=so_far.operations_checked + len(rows),
        events_checked=so_far.events_checked + sum(int(row["events"]) for row in rows),
        broken=(*so_far.broken, *broken),
    )
