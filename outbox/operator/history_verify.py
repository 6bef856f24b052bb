"""``outbox history verify`` (the checkpoint chain) and ``outbox ops verify --archive
FILE`` (an export, against the database's checkpoint when it can be reached):
docs/operating.md, "History retention", and docs/design.md section 15.

An export proves little on its own: whoever can write the file can write a checkpoint
line that agrees with it. What the database recorded when the day was exported can't
be forged that way: the checkpoint row with the line's id, day, counts, digest and hash,
in a chain of checkpoints whose every link and head still hold.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import psycopg

from outbox import store
from outbox.cli.run import print_json
from outbox.connections import command_transaction
from outbox.errors import ServiceUnavailable
from outbox.history_file import (
    ArchivedLink,
    ArchiveReport,
    ArchiveUnreadable,
    Checkpoint,
    verify_archive,
)
from outbox.operator import render
from outbox.operator.history_days import DayVerdict, day_json, day_text, verify_days
from outbox.settings import Settings
from outbox.store import Store
from outbox.text import printable

# What each broken link of the checkpoint chain means, for the text output.
CHECKPOINT_REASONS = {
    "hash_mismatch": "this checkpoint was changed after it was written",
    "prev_mismatch": "it does not follow the checkpoint before it: one was deleted or rewritten",
    "missing_tail": "the head counts more checkpoints than are left: the newest were deleted",
    "anchor_mismatch": "the head names another last checkpoint, or is gone: written around "
    "the chain trigger",
}

OFFLINE_NOTE = (
    "offline-only evidence: the file agrees with its own checkpoint line, and anyone who "
    "can write the file can write that line too; no database checkpoint was compared"
)


def _link_json(link: store.CheckpointLink) -> dict[str, Any]:
    return {"seq": link.seq, "checkpoint_id": link.checkpoint_id, "reason": link.reason}


def _link_text(link: store.CheckpointLink) -> str:
    where = f"checkpoint #{link.checkpoint_id}" if link.checkpoint_id is not None else "the head"
    return f"seq {link.seq} ({where}): {link.reason}, {CHECKPOINT_REASONS.get(link.reason, '')}"


def chain_verdict(chain: store.CheckpointChainReport) -> str:
    first = chain.first_broken
    if first is None:
        return f"checkpoint chain intact: {chain.checked} checkpoint(s), every link and the head"
    return (
        f"checkpoint chain BROKEN: first broken link at {_link_text(first)}; "
        f"{len(chain.broken)} broken link(s) in {chain.checked} checkpoint(s)"
    )


def cmd_history_verify(args: argparse.Namespace, settings: Settings) -> int:
    """Walk the checkpoint chain, and with ``--days`` or ``--day D`` compare each day's
    rows with its checkpoints. Exit 0 intact, 1 a broken link or a day that disagrees."""
    every_day = args.days or args.day is not None
    with command_transaction(settings) as connection:
        chain = Store(connection).run(store.verify_checkpoints())
    days = _verify_days(settings, args.day) if every_day else []
    failed = [verdict for verdict in days if verdict.failed]
    if args.json:
        first = chain.first_broken
        report: dict[str, Any] = {
            "intact": chain.intact and not failed,
            "checkpoints_checked": chain.checked,
            "first_broken": _link_json(first) if first is not None else None,
            "broken": [_link_json(link) for link in chain.broken],
        }
        if every_day:
            report["days_checked"] = len(days)
            report["days_failed"] = len(failed)
            report["days"] = [day_json(verdict) for verdict in days]
        print_json(report)
    else:
        print(chain_verdict(chain))
        for link in chain.broken[1:]:
            print(f"  {_link_text(link)}")
        for verdict in days:
            print(day_text(verdict))
        if every_day:
            print(
                f"{len(days)} day(s) compared with their checkpoints: "
                + (f"{len(failed)} DISAGREE" if failed else "every one agrees")
            )
    return 0 if chain.intact and not failed else 1


def _verify_days(settings: Settings, day: date | None) -> list[DayVerdict]:
    """Each day in a REPEATABLE READ transaction of its own: its checkpoints and its rows
    from one snapshot (an archive batch committed between the two reads would look like a
    change), and no snapshot held while a whole history is read (it would hold back
    vacuum on every table for as long)."""
    with command_transaction(settings) as connection:
        listed = [record.settled_on for record in Store(connection).run(store.day_records(day))]
    verdicts: list[DayVerdict] = []
    for each in listed:
        with command_transaction(settings) as connection:
            connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            verdicts.extend(Store(connection).run(verify_days(each)))
    return verdicts


@dataclass(frozen=True)
class DatabaseCheck:
    """The export's checkpoint line against the database: the row it names (None: the
    database recorded no such checkpoint), the fields that differ, and the chain."""

    row: store.DayCheckpoint | None
    differences: tuple[str, ...]
    chain: store.CheckpointChainReport

    @property
    def confirmed(self) -> bool:
        return self.row is not None and not self.differences and self.chain.intact


def _differences(line: Checkpoint, row: store.DayCheckpoint) -> tuple[str, ...]:
    pairs: list[tuple[str, Any, Any]] = [
        ("settled_on", line.settled_on, row.settled_on),
        ("operations", line.operations, row.operations),
        ("events", line.events, row.events),
        ("digest", line.digest, row.digest),
    ]
    # A line written before version 14 names no row; one written since must name this one.
    if line.id is not None or line.seq is not None or line.hash is not None:
        pairs += [
            ("id", line.id, row.id),
            ("seq", line.seq, row.seq),
            ("hash", line.hash, row.hash),
        ]
    return tuple(
        f"{name} (file {file_value}, database {database_value})"
        for name, file_value, database_value in pairs
        if file_value != database_value
    )


def _database_check(settings: Settings, line: Checkpoint) -> DatabaseCheck:
    with command_transaction(settings) as connection:
        runner = Store(connection)
        row = runner.run(store.checkpoint_of_export(line.id, line.settled_on, line.digest))
        chain = runner.run(store.verify_checkpoints())
    return DatabaseCheck(row, _differences(line, row) if row else (), chain)


def _database_json(check: DatabaseCheck) -> dict[str, Any]:
    row = check.row
    return {
        "confirmed": check.confirmed,
        "checkpoint": None
        if row is None
        else {
            "id": row.id,
            "seq": row.seq,
            "kind": row.kind,
            "settled_on": row.settled_on.isoformat(),
            "operations": row.operations,
            "events": row.events,
            "digest": row.digest,
            "hash": row.hash,
            "recorded_by": row.recorded_by,
            "recorded_at": row.recorded_at.isoformat() if row.recorded_at else None,
        },
        "differences": list(check.differences),
        "chain_intact": check.chain.intact,
        "checkpoints_checked": check.chain.checked,
        "chain_first_broken": _link_json(check.chain.first_broken)
        if check.chain.first_broken is not None
        else None,
    }


def _database_text(check: DatabaseCheck, line: Checkpoint) -> str:
    row = check.row
    if row is None:
        named = f"checkpoint #{line.id}" if line.id is not None else "no checkpoint"
        return (
            f"database: MISMATCH, {named} of {line.settled_on.isoformat()} with digest "
            f"{line.digest} was recorded: the file's checkpoint line is not one this "
            "database wrote"
        )
    if check.differences:
        return (
            f"database: MISMATCH, checkpoint #{row.id} (seq {row.seq}) differs from the "
            f"file's line: {'; '.join(check.differences)}"
        )
    matched = f"database: checkpoint #{row.id} (seq {row.seq}, {row.kind} by " + (
        f"{printable(str(row.recorded_by))} at {row.recorded_at}) states the same day, counts "
        "and digest"
    )
    if line.hash is None:
        matched += " (the file's line predates chained checkpoints: found by day and digest)"
    return f"{matched}\ndatabase: {chain_verdict(check.chain)}"


def verify_export(path: Path, as_json: bool, settings: Settings, *, offline: bool) -> int:
    """``ops verify --archive FILE``: every chain in an export and its checkpoint line;
    then, unless ``offline`` or the database cannot be reached, that line against the
    database's checkpoint row and the checkpoint chain. Exit 0 intact (and confirmed
    when the database was asked), 1 broken or not matching, 2 unreadable."""
    try:
        found = verify_archive(path)
    except ArchiveUnreadable as error:
        print(f"outbox ops verify: {printable(str(error))}; nothing was checked", file=sys.stderr)
        return 2
    check: DatabaseCheck | None = None
    reason = "--offline"
    if not offline:
        try:
            check = _database_check(settings, found.checkpoint)
        except ServiceUnavailable as error:
            reason = f"the database could not be reached: {error}"
    if as_json:
        print_json(_export_json(found, check, reason))
    else:
        _print_export(path, found, check, reason)
    return 0 if found.intact and (check is None or check.confirmed) else 1


def _export_json(found: ArchiveReport, check: DatabaseCheck | None, reason: str) -> dict[str, Any]:
    report = _report(found)
    return {
        **render.chain_json(report),
        "intact": found.intact and (check is None or check.confirmed),
        "settled_on": found.checkpoint.settled_on.isoformat(),
        "checkpoint_digest": found.checkpoint.digest,
        "computed_digest": found.computed_digest,
        "digest_matches": found.digest_matches,
        "evidence": "offline" if check is None else "database",
        "offline_reason": reason if check is None else None,
        "database": _database_json(check) if check is not None else None,
    }


def _print_export(
    path: Path, found: ArchiveReport, check: DatabaseCheck | None, reason: str
) -> None:
    day = found.checkpoint.settled_on.isoformat()
    print(f"{printable(str(path))} ({day}): {render.chain_text(_report(found), None)}")
    if found.digest_matches:
        print(f"checkpoint digest {found.checkpoint.digest} matches the file")
    else:
        print(
            f"checkpoint MISMATCH: it names {found.checkpoint.operations} operation(s), "
            f"{found.checkpoint.events} event(s), digest {found.checkpoint.digest}; the file "
            f"holds {found.operations_checked}, {found.events_checked}, digest "
            f"{found.computed_digest}"
        )
    if check is None:
        print(f"{OFFLINE_NOTE} ({printable(reason)})")
    else:
        print(_database_text(check, found.checkpoint))


def archived_report(
    links: Iterable[ArchivedLink], operations: int, events: int
) -> store.ChainReport:
    """Broken links found in an archived row or an export, as ``ops verify`` reports them."""
    return store.ChainReport(
        operations_checked=operations,
        events_checked=events,
        broken=tuple(
            store.BrokenLink(link.operation_id, link.event_id, link.reason) for link in links
        ),
    )


def _report(found: ArchiveReport) -> store.ChainReport:
    return archived_report(found.broken, found.operations_checked, found.events_checked)
