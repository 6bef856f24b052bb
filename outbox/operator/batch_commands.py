"""``outbox ops resolve`` over a filter: the flags that select escalations, the dry run
that lists them, the confirmation that names their count, and the report of what was
resolved and what was refused. The selection and the writes are
:mod:`outbox.operator.batch`; ``outbox ops resolve OP_ID`` stays in
:mod:`outbox.operator.commands`, which hands a filtered call here.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from outbox.cli.arguments import positive_int_up_to, since
from outbox.cli.run import EXIT_FAILED, print_json
from outbox.connections import command_transaction
from outbox.contracts import Registry
from outbox.errors import ConfigurationError
from outbox.models import display_operation_id
from outbox.operator import batch
from outbox.operator import input as person_input
from outbox.operator.render import stamp
from outbox.operator.rules import Resolution
from outbox.settings import Settings
from outbox.store import EscalationFilter, EscalationSelection, Store
from outbox.text import printable

# How many selected operations the text lists; --json lists them all.
SHOWN = 50
_FILTERS = ("tool", "reason", "run_id", "since", "until")
_BATCH_ONLY = ("yes", "limit", "json")


def add_batch_flags(parser: argparse.ArgumentParser) -> None:
    """The filter, the bound and the confirmation of ``outbox ops resolve``."""
    group = parser.add_argument_group(
        "many at once",
        "Instead of OP_ID, select escalated operations by their latest escalation (every "
        "condition given must match). Without --yes: a dry run that lists them and changes "
        "nothing (on a terminal, it then asks you to type their count). Each one is "
        "resolved in its own transaction under the rules of a single resolve; refusals "
        "are reported and do not stop the batch. --committed is refused: it needs each "
        "operation's own provider reference.",
    )
    group.add_argument("--tool", help="only escalations of this tool")
    group.add_argument("--reason", help="only escalations for this reason (ops list shows it)")
    group.add_argument("--run", dest="run_id", help="only escalations of this run id")
    when = "an ISO 8601 time (UTC unless it has an offset) or a duration back from now"
    group.add_argument("--since", type=since, help=f"only those escalated since then: {when}")
    group.add_argument("--until", type=since, help=f"only those escalated before then: {when}")
    group.add_argument(
        "--limit",
        type=positive_int_up_to(batch.MAX_BATCH),
        help=f"resolve at most N, oldest escalation first (default {batch.DEFAULT_BATCH}, "
        f"at most {batch.MAX_BATCH}); a second run takes the rest",
    )
    group.add_argument("--yes", action="store_true", help="resolve them: no dry run, no question")
    group.add_argument("--json", action="store_true", help="one JSON document instead of text")


def is_batch(args: argparse.Namespace) -> bool:
    """Whether this ``ops resolve`` selects by filter; a mix of both, or neither, is a
    usage error."""
    filtered = any(getattr(args, name) is not None for name in _FILTERS)
    if args.operation_id is not None:
        used = [
            name for name in (*_FILTERS, *_BATCH_ONLY) if getattr(args, name) not in (None, False)
        ]
        if used:
            flags = ", ".join("--" + ("run" if n == "run_id" else n) for n in used)
            raise ConfigurationError(f"{flags} select many operations: give OP_ID or a filter")
        return False
    if not filtered:
        raise ConfigurationError(
            "name the operation (OP_ID), or select escalations with --tool, --reason, --run, "
            "--since or --until"
        )
    if args.force:
        raise ConfigurationError(
            "--force goes with one OP_ID: a batch resolves escalated operations only"
        )
    if args.provider_ref is not None:
        raise ConfigurationError("--provider-ref goes with one OP_ID and --committed")
    return True


def resolve_many(
    args: argparse.Namespace,
    settings: Settings,
    resolution: Resolution,
    person: str,
    registry: Registry | None,
) -> int:
    """Exit 0 after a dry run or a batch with nothing refused; 1 when anything was
    refused, the batch stopped, or the confirmation was not given."""
    batch.batch_resolution(resolution)
    # Judged before the dry run too: a listing must not end in a refusal at --yes.
    person_input.evidence(args.evidence)
    where = EscalationFilter(**{name: getattr(args, name) for name in _FILTERS})
    with command_transaction(settings) as connection:
        connection.read_only = True
        selection = batch.select(Store(connection), where, args.limit)
    interactive = not args.yes and not args.json and sys.stdin.isatty()
    if not args.yes:
        if args.json:
            print_json(selection_json(selection, where))
        else:
            print(selection_text(selection, where, resolution, person))
        if not interactive or not selection.escalations:
            return 0
        count = len(selection.escalations)
        answer = input(f"Resolve these {count} operations as {resolution}? Type {count}: ")
        if answer.strip() != str(count):
            print("not confirmed: nothing was changed", file=sys.stderr)
            return EXIT_FAILED
    with command_transaction(settings) as connection:
        report = batch.resolve_selected(
            connection,
            selection,
            resolution,
            by=person,
            evidence=args.evidence,
            registry=registry,
        )
    if args.json:
        print_json(report_json(report))
    else:
        print(report_text(report, args.limit or batch.DEFAULT_BATCH))
    return 0 if not report.refused and report.stopped is None else EXIT_FAILED


def _filter_words(where: EscalationFilter) -> str:
    words = []
    for name in _FILTERS:
        value = getattr(where, name)
        if isinstance(value, datetime):
            value = stamp(value)
        elif isinstance(value, timedelta):
            value = f"{int(value.total_seconds())}s ago"
        if value is not None:
            words.append(f"{name.replace('_id', '')} {printable(str(value))}")
    return ", ".join(words)


def _pinned_flags(where: EscalationFilter, selected_at: datetime) -> str:
    closed = batch.pinned(where, selected_at)
    flags = []
    for name in _FILTERS:
        value = getattr(closed, name)
        if value is None:
            continue
        text = value.astimezone(UTC).isoformat() if isinstance(value, datetime) else str(value)
        flags += ["--" + ("run" if name == "run_id" else name), printable(text)]
    return shlex.join(flags)


def selection_text(
    selection: EscalationSelection, where: EscalationFilter, resolution: Resolution, by: str
) -> str:
    count = len(selection.escalations)
    lines = [
        f"dry run: {selection.matched} escalated operation(s) match ({_filter_words(where)}); "
        f"{count} would be resolved as {resolution} by {printable(by)}, oldest escalation "
        "first. Nothing was changed."
    ]
    if not count:
        return lines[0]
    lines.append(f"{'OPERATION':<39}  {'TOOL':<20}  {'RUN':<20}  {'ESCALATED BECAUSE':<22}  AT")
    for e in selection.escalations[:SHOWN]:
        s = e.operation
        lines.append(
            f"{display_operation_id(s.id):<39}  {printable(s.tool_name):<20}  "
            f"{printable(s.run_id):<20}  {printable(e.reason or '-'):<22}  {stamp(e.escalated_at)}"
        )
    if count > SHOWN:
        lines.append(f"... and {count - SHOWN} more (--json lists them all)")
    if selection.matched > count:
        lines.append(f"{selection.matched - count} more match beyond the batch's bound (--limit)")
    lines.append(
        "to resolve exactly these (none escalated after this listing), run the same command "
        f"with --yes and {_pinned_flags(where, selection.selected_at)}"
    )
    return "\n".join(lines)


def selection_json(selection: EscalationSelection, where: EscalationFilter) -> dict[str, Any]:
    return {
        "dry_run": True,
        "matched": selection.matched,
        "selected": len(selection.escalations),
        # Where a confirmed run's window closes to resolve exactly these (--until).
        "selected_at": selection.selected_at.isoformat(),
        "operations": [
            {
                "id": display_operation_id(e.operation.id),
                "tool": e.operation.tool_name,
                "tool_version": e.operation.tool_version,
                "run_id": e.operation.run_id,
                "reason": e.reason,
                "escalated_at": e.escalated_at.isoformat(),
            }
            for e in selection.escalations
        ],
    }


def report_json(report: batch.BatchReport) -> dict[str, Any]:
    return {
        "dry_run": False,
        "batch_id": str(report.batch_id),
        "resolution": str(report.resolution),
        "by": report.by,
        "matched": report.matched,
        "selected": report.selected,
        "resolved": [r.after.display_id for r in report.resolved],
        "refused": [{"id": r.display_id, "why": r.why} for r in report.refused],
        "not_tried": report.not_tried,
        "left_out": report.left_out,
        "stopped": report.stopped,
    }


def report_text(report: batch.BatchReport, limit: int) -> str:
    lines = [
        f"batch {report.batch_id}: {len(report.resolved)} of {report.selected} selected "
        f"resolved as {report.resolution} by {printable(report.by)}; each operation.resolved "
        "event carries this batch_id"
    ]
    if report.refused:
        lines.append(f"refused {len(report.refused)} (nothing changed for them):")
        lines += [f"  {r.display_id}: {printable(r.why)}" for r in report.refused]
    if report.stopped is not None:
        lines.append(f"stopped: {report.stopped}; {report.not_tried} not tried: run it again")
    if report.left_out:
        lines.append(
            f"{report.left_out} more matched beyond --limit {limit}: run the command again for them"
        )
    return "\n".join(lines)
