"""History retention (docs/design.md section 15, docs/operating.md "History retention"):
moving settled operations out of the hot tables into ``history``, a day at a time out of
the database, and reading what was moved.

The plans run in the caller's transaction like every other. Dropping a day cannot: its
``ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY`` runs only outside a transaction
block, on a connection of the tables' owner, so :func:`drop_partition` takes a psycopg
connection in autocommit and composes its two statements with :mod:`psycopg.sql`, the
partition's name being an identifier no query parameter can carry (as
:mod:`outbox.schema` composes CREATE DATABASE).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
import psycopg.sql

from outbox.errors import wrap_database_errors
from outbox.models import Approval, Callback, Operation
from outbox.states import OperationState
from outbox.store.console import EventsPage, page_of_events, page_parameters
from outbox.store.operator import OperationSummary, prefix_range
from outbox.store.runner import Plan, Row, Step

# Rows per statement of an export: each is one operation's whole evidence.
EXPORT_PAGE_SIZE = 500
_FIRST_UUID = UUID(int=0)
# What a drop waits for a lock at most before it gives up (and leaves the day for the
# next run): the detach waits for the transactions that still see the partition.
DROP_LOCK_TIMEOUT = "10s"


@dataclass(frozen=True)
class DayCheckpoint:
    """A checkpoint row: what left (archived), was exported or was dropped of one day,
    and (when read back from the table) its place in the checkpoint chain: ``seq``, the
    hash of the one before it and its own, hex."""

    settled_on: date
    operations: int
    events: int
    digest: str
    kind: str = "archived"
    recorded_by: str | None = None
    recorded_at: datetime | None = None
    id: int | None = None
    seq: int | None = None
    prev_hash: str | None = None
    hash: str | None = None


@dataclass(frozen=True)
class DayDigest:
    """What a day of history holds, as a checkpoint of it would state it."""

    operations: int
    events: int
    digest: str


@dataclass(frozen=True)
class CheckpointLink:
    """One place where the checkpoint chain disagrees with itself. ``reason``:
    ``hash_mismatch`` (the row changed), ``prev_mismatch`` (it does not follow the one
    before it: a row before it was deleted or rewritten), ``missing_tail`` (the head
    counts more rows than are left: the newest were deleted; ``checkpoint_id`` is None),
    ``anchor_mismatch`` (the head names another last row, or is missing)."""

    seq: int
    checkpoint_id: int | None
    reason: str


@dataclass(frozen=True)
class CheckpointChainReport:
    """What a walk of the checkpoint chain found: how many rows, and every broken link
    in seq order."""

    checked: int
    broken: tuple[CheckpointLink, ...]

    @property
    def intact(self) -> bool:
        return not self.broken

    @property
    def first_broken(self) -> CheckpointLink | None:
        return self.broken[0] if self.broken else None


@dataclass(frozen=True)
class HistoryDay:
    """One day of history: its partition and what it holds."""

    settled_on: date
    partition: str
    operations: int
    events: int
    detaching: bool
    counted: bool = False
    """Whether ``operations`` and ``events`` were counted from the partition's rows (a
    day with a dropped checkpoint that is still attached) rather than summed from its
    archived checkpoints."""


def _checkpoint(row: Row, kind: str | None = None) -> DayCheckpoint:
    return DayCheckpoint(
        settled_on=row["settled_on"],
        operations=int(row["operations"]),
        events=int(row["events"]),
        digest=row["digest"],
        kind=kind or row.get("kind", "archived"),
        recorded_by=row.get("recorded_by"),
        recorded_at=row.get("recorded_at"),
        id=row.get("id"),
        seq=row.get("seq"),
        prev_hash=row.get("prev_hash"),
        hash=row.get("hash"),
    )


def archive_batch(hot: timedelta, batch: int) -> Plan[list[DayCheckpoint]]:
    """Move at most ``batch`` settled operations older than ``hot`` into history; one
    checkpoint per day touched, none when nothing was left to move. Commit after each."""
    rows = yield Step("history_archive_batch", {"hot": hot, "batch": batch})
    return [_checkpoint(row) for row in rows]


def checkpoint_day(day: date, kind: str) -> Plan[DayCheckpoint]:
    """Record and return the checkpoint of one whole day (``exported`` or ``dropped``)."""
    rows = yield Step("history_checkpoint_day", {"day": day, "kind": kind})
    return _checkpoint(rows[0], kind)


def day_digest(day: date, *, flat: bool = False) -> Plan[DayDigest]:
    """What ``day`` holds as the caller's transaction sees it: an export compares its
    snapshot with the checkpoint it recorded just before. ``flat``: its digest as
    schema versions before 16 computed it, every line in one block (a day of more than
    ten million operations exceeds what Postgres can hold in one value, and fails)."""
    if flat:
        rows = yield Step("history_day_flat_digest", {"day": day})
    else:
        rows = yield Step("history_day_digest", {"day": day})
    row = rows[0]
    return DayDigest(int(row["operations"]), int(row["events"]), str(row["digest"]))


def checkpoint_of_export(
    checkpoint_id: int | None, day: date, digest: str
) -> Plan[DayCheckpoint | None]:
    """The checkpoint row an export's first line names: by id when it has one, else the
    day's exported or dropped checkpoint with that digest; None when there is none."""
    rows = yield Step(
        "history_checkpoint_of_export", {"id": checkpoint_id, "day": day, "digest": digest}
    )
    return _checkpoint(rows[0]) if rows else None


def verify_checkpoints() -> Plan[CheckpointChainReport]:
    """Walk the whole checkpoint chain and its head."""
    rows = yield Step("verify_checkpoint_chain", {})
    return CheckpointChainReport(
        checked=int(rows[0]["checked"]),
        broken=tuple(
            CheckpointLink(int(link["seq"]), link["checkpoint_id"], str(link["reason"]))
            for link in rows[0]["broken"]
        ),
    )


def export_lines(day: date, after: UUID | None = None) -> Plan[list[tuple[UUID, str]]]:
    """One page of a day's rows, each as Postgres prints it, after ``after``."""
    rows = yield Step(
        "history_export_page",
        {"day": day, "after": after or _FIRST_UUID, "limit": EXPORT_PAGE_SIZE},
    )
    return [(row["operation_id"], row["line"]) for row in rows]


def history_days() -> Plan[list[HistoryDay]]:
    """Every day history holds, oldest first, with what the archive's checkpoints
    recorded moving into it: the rows themselves are read only for a day whose drop was
    recorded and which is still attached, where the checkpoints cannot say."""
    rows = yield Step("history_days", {})
    days = []
    for row in rows:
        counted = bool(row["drop_recorded"])
        counts = row
        if counted:
            [counts] = yield Step("history_day_rows", {"day": row["settled_on"]})
        days.append(
            HistoryDay(
                settled_on=row["settled_on"],
                partition=row["partition"],
                operations=int(counts["operations"]),
                events=int(counts["events"]),
                detaching=bool(row["detaching"]),
                counted=counted,
            )
        )
    return days


@dataclass(frozen=True)
class DayRecord:
    """What the checkpoints record of one day: for ``history verify --days``."""

    settled_on: date
    attached: bool
    """Whether the day's partition is attached (a day with no drop recorded should be)."""
    archived_operations: int
    archived_events: int
    archived_checkpoints: int
    drop_recorded: bool
    newest_id: int | None
    newest_kind: str | None
    newest_digest: str | None
    exports_disagreeing: tuple[int, ...]
    """Exports whose counts are not the sums archived before them."""

    @property
    def recorded_digest(self) -> tuple[int, str] | None:
        """(checkpoint id, digest) of the whole day as it should be now: its newest
        checkpoint when that is an export, or its only archived one; None when the day
        was moved in several batches since its last export (their digests cover a batch
        each, so only the counts can be compared)."""
        if self.newest_id is None or self.newest_digest is None:
            return None
        if self.newest_kind == "exported" or (
            self.newest_kind == "archived" and self.archived_checkpoints == 1
        ):
            return self.newest_id, self.newest_digest
        return None


def day_records(day: date | None = None) -> Plan[list[DayRecord]]:
    """What the checkpoints record of ``day``, or of every day history holds or should
    hold (a day dropped as recorded is left out), oldest first."""
    rows = yield Step("history_day_records", {"day": day})
    return [
        DayRecord(
            settled_on=row["settled_on"],
            attached=bool(row["attached"]),
            archived_operations=int(row["archived_operations"]),
            archived_events=int(row["archived_events"]),
            archived_checkpoints=int(row["archived_checkpoints"]),
            drop_recorded=bool(row["drop_recorded"]),
            newest_id=row["newest_id"],
            newest_kind=row["newest_kind"],
            newest_digest=row["newest_digest"],
            exports_disagreeing=tuple(int(i) for i in row["exports_disagreeing"]),
        )
        for row in rows
    ]


def recent_checkpoints(limit: int) -> Plan[list[DayCheckpoint]]:
    """The newest checkpoints, newest first."""
    rows = yield Step("history_recent_checkpoints", {"limit": limit})
    return [_checkpoint(row) for row in rows]


def archived_operation(operation_id: UUID) -> Plan[str | None]:
    """The archived operation's history row as Postgres prints it, or None."""
    rows = yield Step("history_operation", {"id": operation_id})
    return str(rows[0]["line"]) if rows else None


@dataclass(frozen=True)
class ArchivedOperation:
    """An operation only history holds, as it was when it moved (its input included):
    the operator's to read, never to change. Its events are read a page at a time
    (:func:`archived_events_page`)."""

    operation: Operation
    settled_on: date
    """The day (UTC) it settled: its partition of history, dropped after the retention."""
    settled_at: datetime
    archived_at: datetime
    """When it moved out of the hot tables."""
    callbacks: list[Callback]
    approvals: list[Approval]
    """Oldest first, each with who decided."""
    event_count: int
    last_hash: str | None


def archived_facts(operation_id: UUID) -> Plan[ArchivedOperation | None]:
    """An archived operation without its events, or None when history does not hold it."""
    rows = yield Step("history_operation_facts", {"id": operation_id})
    if not rows:
        return None
    row = rows[0]
    return ArchivedOperation(
        operation=Operation.model_validate(row["operation"]),
        settled_on=row["settled_on"],
        settled_at=row["settled_at"],
        archived_at=row["archived_at"],
        callbacks=[Callback.model_validate(c) for c in row["callbacks"]],
        approvals=[Approval.model_validate(a) for a in row["approvals"]],
        event_count=int(row["event_count"]),
        last_hash=row["last_hash"],
    )


def archived_events_page(
    operation_id: UUID,
    *,
    after_id: int | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> Plan[EventsPage]:
    """:func:`~outbox.store.events_page` for an archived operation, from its history row
    (an operation history does not hold has an empty timeline)."""
    rows = yield Step(
        "history_events_page", page_parameters(operation_id, after_id, before_id, limit)
    )
    return page_of_events(rows)


def archived_ids_with_prefix(hex_prefix: str) -> Plan[list[UUID]]:
    """:func:`~outbox.store.operations_with_prefix` in history: at most two archived
    operation ids that start with ``hex_prefix``."""
    rows = yield Step("history_ids_in_range", prefix_range(hex_prefix))
    return [row["id"] for row in rows]


def archived_states(operation_ids: list[UUID]) -> Plan[dict[UUID, OperationState]]:
    """The final state of each of ``operation_ids`` that history holds."""
    if not operation_ids:
        return {}
    rows = yield Step("history_states", {"ids": operation_ids})
    return {row["operation_id"]: OperationState(row["state"]) for row in rows}


@dataclass(frozen=True)
class ArchivedSummary:
    """An archived operation in a listing: what a hot one shows, and when it moved."""

    summary: OperationSummary
    archived_at: datetime


def archived_summaries(
    *,
    states: list[OperationState] | None = None,
    tool: str | None = None,
    since: datetime | None = None,
    within: timedelta | None = None,
    limit: int = 50,
) -> Plan[list[ArchivedSummary]]:
    """:func:`~outbox.store.list_operation_summaries` over history: archived operations
    by settled time, newest first, at most ``limit``."""
    rows = yield Step(
        "history_summaries",
        {
            "states": [str(s) for s in states] if states else None,
            "tool": tool,
            "since": since,
            "ago": within,
            "limit": limit,
        },
    )
    return [
        ArchivedSummary(summary=OperationSummary.from_row(row), archived_at=row["archived_at"])
        for row in rows
    ]


def rotate_keys(retention: timedelta) -> Plan[bool]:
    """Forget the older generation of archived decision keys once all of it is older
    than ``retention``; whether it did. The tables' owner only."""
    rows = yield Step("history_rotate_keys", {"retention": retention})
    return bool(rows[0]["rotated"])


@dataclass(frozen=True)
class DropTiming:
    """How long each statement of a day's drop took, in seconds: the detach holds SHARE
    UPDATE EXCLUSIVE on history (no reader or writer waits for it), the drop ACCESS
    EXCLUSIVE on the detached partition alone."""

    detach_seconds: float
    drop_seconds: float

    @property
    def lock_seconds(self) -> float:
        return self.detach_seconds + self.drop_seconds


def drop_partition(
    connection: psycopg.Connection[Any], partition: str, *, finish_detach: bool = False
) -> DropTiming:
    """Detach ``partition`` from history concurrently and drop it, on ``connection`` (the
    tables' owner, in autocommit). ``finish_detach``: a detach of it was interrupted, and
    is finished instead (``DETACH ... FINALIZE``)."""
    table = psycopg.sql.Identifier(partition)
    detach = (
        "ALTER TABLE history DETACH PARTITION {} FINALIZE"
        if finish_detach
        else "ALTER TABLE history DETACH PARTITION {} CONCURRENTLY"
    )
    with wrap_database_errors("drop_partition"):
        connection.execute(
            psycopg.sql.SQL("SET lock_timeout = {}").format(psycopg.sql.Literal(DROP_LOCK_TIMEOUT))
        )
        started = time.monotonic()
        connection.execute(psycopg.sql.SQL(detach).format(table))
        detached = time.monotonic()
        connection.execute(psycopg.sql.SQL("DROP TABLE {}").format(table))
        dropped = time.monotonic()
    return DropTiming(detach_seconds=detached - started, drop_seconds=dropped - detached)
