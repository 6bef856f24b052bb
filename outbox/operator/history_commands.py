"""``outbox history`` (archive, drop, export, status, verify) and what ``outbox ops
verify`` does for an operation that left the hot tables (``ops show`` and ``ops list
--archived`` are :mod:`outbox.operator.archived`): docs/operating.md, "History
retention", and docs/design.md section 15.

``archive`` and ``export`` and ``status`` run as an operator. ``drop`` runs as the tables'
owner (the login ``outbox migrate`` runs as): it detaches a day's partition of
``history`` with ``DETACH PARTITION ... CONCURRENTLY``, which no function and no
transaction block may run, and drops it, printing how long each statement held its lock.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, TypeAlias
from uuid import UUID

import psycopg
import psycopg.errors

from outbox import store
from outbox.cli.arguments import add_setting_flags, duration, positive_int_up_to
from outbox.cli.run import print_json
from outbox.connections import command_transaction
from outbox.errors import (
    ConfigurationError,
    DatabaseError,
    OperationNotFound,
    ServiceUnavailable,
    connect_failure,
)
from outbox.history_file import broken_links, load_line
from outbox.models import display_operation_id
from outbox.operator import render, views
from outbox.operator.history_verify import archived_report, cmd_history_verify, verify_export
from outbox.settings import Settings
from outbox.store import Store
from outbox.text import printable
from outbox.urls import redact_url

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

DEFAULT_BATCH = 500
# The most outbox_history_archive moves in one transaction (schema.sql): each operation
# holds two advisory locks to the commit, in the lock table every session shares.
MAX_BATCH = 1_000
RECENT_CHECKPOINTS = 10
# An export records its checkpoint, then reads the day; this many times at most.
EXPORT_TRIES = 3


def _span(value: timedelta) -> str:
    """A window as the flags take it: 7d, 12h, 30m, 45s."""
    seconds = int(value.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{value.total_seconds():g}s"


def _hot(args: argparse.Namespace, settings: Settings) -> timedelta:
    hot: timedelta = args.hot or settings.history_hot
    if hot >= settings.history_retention:
        raise ConfigurationError(
            f"--hot {_span(hot)} must be shorter than the retention "
            f"({_span(settings.history_retention)}, "
            "OUTBOX_HISTORY_RETENTION): an operation moves to history before its day is dropped"
        )
    return hot


def cmd_history_archive(args: argparse.Namespace, settings: Settings) -> int:
    """Move every settled operation older than the hot window, a batch per transaction."""
    hot = _hot(args, settings)
    moved: dict[date, list[int]] = {}
    started = time.monotonic()
    batches = 0
    while True:
        with command_transaction(settings) as connection:
            checkpoints = Store(connection).run(store.archive_batch(hot, args.batch))
        if not checkpoints:
            break
        batches += 1
        for checkpoint in checkpoints:
            counts = moved.setdefault(checkpoint.settled_on, [0, 0])
            counts[0] += checkpoint.operations
            counts[1] += checkpoint.events
    elapsed = time.monotonic() - started
    if args.json:
        print_json(
            {
                "batches": batches,
                "seconds": round(elapsed, 3),
                "days": [
                    {"settled_on": day.isoformat(), "operations": ops, "events": events}
                    for day, (ops, events) in sorted(moved.items())
                ],
            }
        )
        return 0
    total = sum(counts[0] for counts in moved.values())
    print(
        f"moved {total} settled operation(s) older than {_span(hot)} into history "
        f"in {batches} batch(es), {elapsed:.2f} s"
    )
    for day, (operations, events) in sorted(moved.items()):
        print(f"  {day.isoformat()}  {operations} operation(s), {events} event(s)")
    return 0


def _export(settings: Settings, day: date, directory: Path) -> tuple[Path, store.DayCheckpoint]:
    """One day of history to ``directory/history-<day>.jsonl``: its checkpoint, then one
    line per operation; written beside and renamed, so a file of that name is whole.

    The checkpoint is recorded in a transaction of its own: its insert waits for the
    checkpoint chain's head, which a REPEATABLE READ transaction could not take after
    an archive batch moved it (a serialization failure), and which it would hold for the
    whole export. The rows are then read in one REPEATABLE READ snapshot that must hold
    exactly what the checkpoint states; an archive batch that added to the day in
    between makes the export record a new checkpoint and read again."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"history-{day.isoformat()}.jsonl"
    partial = target.with_suffix(".jsonl.partial")
    for _ in range(EXPORT_TRIES):
        with command_transaction(settings) as connection:
            checkpoint = Store(connection).run(store.checkpoint_day(day, "exported"))
        with command_transaction(settings) as connection:
            connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            runner = Store(connection)
            seen = runner.run(store.day_digest(day))
            if (seen.operations, seen.events, seen.digest) != (
                checkpoint.operations,
                checkpoint.events,
                checkpoint.digest,
            ):
                continue
            with partial.open("w", encoding="utf-8") as file:
                file.write(json.dumps({"checkpoint": _checkpoint_json(checkpoint)}) + "\n")
                after: UUID | None = None
                while page := runner.run(store.export_lines(day, after)):
                    file.writelines(line + "\n" for _, line in page)
                    after = page[-1][0]
                file.flush()
                os.fsync(file.fileno())
        partial.replace(target)
        return target, checkpoint
    raise ServiceUnavailable(
        f"{day.isoformat()} kept changing while it was exported ({EXPORT_TRIES} tries: "
        "operations of that day were being moved into history); nothing was written. "
        "Export it again once the archive run is over"
    )


def _checkpoint_json(checkpoint: store.DayCheckpoint) -> dict[str, Any]:
    return {
        "id": checkpoint.id,
        "seq": checkpoint.seq,
        "kind": checkpoint.kind,
        "settled_on": checkpoint.settled_on.isoformat(),
        "operations": checkpoint.operations,
        "events": checkpoint.events,
        "digest": checkpoint.digest,
        "recorded_by": checkpoint.recorded_by,
        "recorded_at": checkpoint.recorded_at.isoformat() if checkpoint.recorded_at else None,
        "prev_hash": checkpoint.prev_hash,
        "hash": checkpoint.hash,
    }


def cmd_history_export(args: argparse.Namespace, settings: Settings) -> int:
    path, checkpoint = _export(settings, args.day, args.out)
    print(
        f"exported {checkpoint.operations} operation(s), {checkpoint.events} event(s) of "
        f"{args.day.isoformat()} to {printable(str(path))} (digest {checkpoint.digest})"
    )
    return 0


def _owner_connection(settings: Settings) -> psycopg.Connection[Any]:
    url = settings.libpq_url
    try:
        return psycopg.connect(url, autocommit=True)
    except psycopg.OperationalError as failure:
        raise ServiceUnavailable(
            f"could not connect to Postgres at {redact_url(url)}: {connect_failure(failure)}"
        ) from None


def _dropped_checkpoint(owner: psycopg.Connection[Any], day: date) -> store.DayCheckpoint:
    try:
        return Store(owner, require_transaction=False).run(store.checkpoint_day(day, "dropped"))
    except DatabaseError as error:
        if isinstance(error.driver_error, psycopg.errors.InsufficientPrivilege):
            raise ConfigurationError(
                "history drop runs as the owner of the outbox tables (the login `outbox "
                "migrate` runs as): no group role may detach or drop a day of history"
            ) from None
        raise


def cmd_history_drop(args: argparse.Namespace, settings: Settings) -> int:
    """Drop every day older than the retention: export it first when asked, write its
    checkpoint, detach it concurrently and drop it; then forget old decision keys."""
    retention: timedelta = args.retention or settings.history_retention
    if retention <= settings.history_hot:
        raise ConfigurationError(
            f"--retention {_span(retention)} must be longer than the hot window "
            f"({_span(settings.history_hot)}, OUTBOX_HISTORY_HOT)"
        )
    before = (datetime.now(UTC) - retention).date()
    with command_transaction(settings) as connection:
        days = [d for d in Store(connection).run(store.history_days()) if d.settled_on < before]
    dropped = []
    with _owner_connection(settings) as owner:
        for day in days:
            if args.export_dir is not None:
                path, _ = _export(settings, day.settled_on, args.export_dir)
                print(f"{day.settled_on.isoformat()}: exported to {printable(str(path))}")
            checkpoint = _dropped_checkpoint(owner, day.settled_on)
            timing = store.drop_partition(owner, day.partition, finish_detach=day.detaching)
            dropped.append((checkpoint, timing))
            print(
                f"{day.settled_on.isoformat()}: dropped {checkpoint.operations} operation(s), "
                f"{checkpoint.events} event(s) (digest {checkpoint.digest}); lock time "
                f"{timing.lock_seconds * 1000:.1f} ms (detach {timing.detach_seconds * 1000:.1f} "
                f"ms, drop {timing.drop_seconds * 1000:.1f} ms)"
            )
        rotated = Store(owner, require_transaction=False).run(store.rotate_keys(retention))
    if not dropped:
        print(f"no day of history is older than {_span(retention)}: nothing dropped")
    if rotated:
        print(
            "archived decision keys: the older generation, all of it settled more than "
            f"{_span(retention)} ago, was cleared and now takes new keys"
        )
    return 0


def cmd_history_status(args: argparse.Namespace, settings: Settings) -> int:
    with command_transaction(settings) as connection:
        runner = Store(connection)
        days = runner.run(store.history_days())
        checkpoints = runner.run(store.recent_checkpoints(RECENT_CHECKPOINTS))
    if args.json:
        print_json(
            {
                "days": [
                    {
                        "settled_on": d.settled_on.isoformat(),
                        "partition": d.partition,
                        "operations": d.operations,
                        "events": d.events,
                        "detaching": d.detaching,
                        "counted_from": "rows" if d.counted else "checkpoints",
                    }
                    for d in days
                ],
                "oldest": days[0].settled_on.isoformat() if days else None,
                "checkpoints": [_checkpoint_json(c) for c in checkpoints],
            }
        )
        return 0
    held = [d for d in days if d.operations]
    print(
        f"history: {len(days)} day partition(s), {sum(d.operations for d in days)} "
        f"operation(s); oldest {held[0].settled_on.isoformat() if held else '-'} (as the "
        "archive's checkpoints recorded each day, not counted row by row)"
    )
    for d in days:
        note = " (detach interrupted: `history drop` finishes it)" if d.detaching else ""
        if d.counted:
            note += " (counted: a drop of this day was recorded, and it is still here)"
        print(
            f"  {d.settled_on.isoformat()}  {d.operations} operation(s), {d.events} event(s){note}"
        )
    print("recent checkpoints:")
    for c in checkpoints:
        print(
            f"  #{c.seq} {c.kind:<8} {c.settled_on.isoformat()}  {c.operations} op(s) "
            f"{c.events} event(s) {c.digest[:16]}  by {printable(str(c.recorded_by))} at "
            f"{c.recorded_at}"
        )
    return 0


# --- ops verify of an archived operation, and of an export ---------------------------


def archived_row(runner: Store, operation_id: UUID) -> dict[str, Any] | None:
    line = runner.run(store.archived_operation(operation_id))
    row: dict[str, Any] | None = load_line(line) if line is not None else None
    return row


def archived_chain(runner: Store, operation_id: UUID) -> store.ChainReport | None:
    """The evidence chain of an operation only history holds, recomputed here (the
    console's operation page); None when history does not hold it."""
    row = archived_row(runner, operation_id)
    return None if row is None else archived_report(broken_links(row), 1, len(row["events"]))


def verify_archived(row: dict[str, Any], as_json: bool) -> int:
    """``ops verify`` of an operation only history holds: its chain recomputed here."""
    operation_id = UUID(str(row["operation_id"]))
    report = archived_report(broken_links(row), 1, len(row["events"]))
    if as_json:
        print_json({**render.chain_json(report), "archived": row["settled_on"]})
    else:
        print(f"{render.chain_text(report, operation_id)} (archived, settled {row['settled_on']})")
    return 0 if report.intact else 1


def add_verify_targets(parser: argparse.ArgumentParser, op_id_help: str) -> None:
    """``outbox ops verify``'s targets: one operation, ``--all``, or an export file
    (``--archive``, with ``--offline``)."""
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "operation_id",
        metavar="OP_ID",
        nargs="?",
        help=op_id_help,
    )
    target.add_argument(
        "--all", dest="all_operations", action="store_true", help="every operation, page by page"
    )
    target.add_argument(
        "--archive",
        type=Path,
        metavar="FILE",
        help="an export of `outbox history export`: every chain in it and its checkpoint "
        "line, then that line against the database's checkpoint row and chain (offline, "
        "and said so, when the database cannot be reached)",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="with --archive: do not ask the database; the file is checked against its "
        "own checkpoint line only, which is offline-only evidence",
    )


def cmd_ops_verify(args: argparse.Namespace, settings: Settings) -> int:
    """Exit 0 when every chain checked is intact, 1 when a link is broken, 2 when the
    operation named does not exist (nothing was checked)."""
    if args.archive is not None:
        return verify_export(args.archive, args.json, settings, offline=args.offline)
    if args.offline:
        raise ConfigurationError(
            "--offline goes with --archive FILE: every other check reads the database"
        )
    operation_id: UUID | None = None
    with command_transaction(settings) as connection:
        runner = Store(connection)
        if args.operation_id is not None:
            try:
                operation_id = views.operation_id_of(runner, args.operation_id)
            except OperationNotFound as error:
                print(
                    f"outbox ops verify: {printable(str(error))}; nothing was checked",
                    file=sys.stderr,
                )
                return 2
        report = runner.run(store.verify_chain(operation_id))
        archived = (
            archived_row(runner, operation_id)
            if operation_id is not None and report.operations_checked == 0
            else None
        )
    if archived is not None:
        return verify_archived(archived, args.json)
    if operation_id is not None and report.operations_checked == 0:
        print(
            f"outbox ops verify: {display_operation_id(operation_id)} is not an operation of "
            "this database; nothing was checked",
            file=sys.stderr,
        )
        return 2
    if args.json:
        print_json(render.chain_json(report))
    else:
        print(render.chain_text(report, operation_id))
    return 0 if report.intact else 1


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a day like 2026-09-01: {text!r}") from None


def configure_history(commands: Commands) -> None:
    """Register ``outbox history`` (archive, drop, export, status, verify)."""
    parser = commands.add_parser(
        "history",
        help="move settled operations into history, export and drop its days",
        description='History retention (docs/operating.md, "History retention"): settled '
        "operations leave the hot tables after OUTBOX_HISTORY_HOT, and their day of history "
        "leaves the database after OUTBOX_HISTORY_RETENTION. Escalations nobody resolved and "
        "operations still waiting never leave.",
    )
    history = parser.add_subparsers(dest="history_command", required=True, metavar="ACTION")

    def leaf(name: str, handler: Any, help_text: str) -> argparse.ArgumentParser:
        sub = history.add_parser(name, help=help_text, description=help_text)
        add_setting_flags(sub, "database_url")
        sub.set_defaults(handler=handler)
        return sub

    archive = leaf(
        "archive",
        cmd_history_archive,
        "move settled operations older than the hot window into history, a batch per "
        "transaction (as an operator)",
    )
    archive.add_argument(
        "--hot", type=duration, help="the hot window, like 7d (default OUTBOX_HISTORY_HOT)"
    )
    archive.add_argument(
        "--batch",
        type=positive_int_up_to(MAX_BATCH),
        default=DEFAULT_BATCH,
        metavar="N",
        help=f"operations per transaction (default {DEFAULT_BATCH}, at most {MAX_BATCH})",
    )
    archive.add_argument("--json", action="store_true", help="one JSON document")

    drop = leaf(
        "drop",
        cmd_history_drop,
        "drop every day of history older than the retention, detaching its partition "
        "concurrently; prints each day's lock time (as the tables' owner)",
    )
    drop.add_argument(
        "--retention",
        type=duration,
        help="how long history keeps a day, like 90d (default OUTBOX_HISTORY_RETENTION)",
    )
    drop.add_argument(
        "--export-dir",
        type=Path,
        metavar="DIR",
        help="export each day to DIR before it is dropped (history export)",
    )

    export = leaf(
        "export",
        cmd_history_export,
        "write one day of history to DIR/history-<day>.jsonl: its checkpoint, then one "
        "operation a line (`ops verify --archive FILE` checks it without a database)",
    )
    export.add_argument("--day", type=_day, required=True, help="the day, like 2026-09-01")
    export.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write")

    status = leaf("status", cmd_history_status, "the days history holds and the newest checkpoints")
    status.add_argument("--json", action="store_true", help="one JSON document")

    verify = leaf(
        "verify",
        cmd_history_verify,
        "walk the chain of history checkpoints and its head; report the first broken link "
        "(exit 1), or that every link holds (exit 0); with --days or --day, also each "
        "day's rows against its checkpoints",
    )
    verify.add_argument("--json", action="store_true", help="one JSON document")
    which = verify.add_mutually_exclusive_group()
    which.add_argument(
        "--days",
        action="store_true",
        help="count and hash every day history holds and compare it with its checkpoints "
        "(reads all of history)",
    )
    which.add_argument("--day", type=_day, default=None, help="the same for one day (YYYY-MM-DD)")
