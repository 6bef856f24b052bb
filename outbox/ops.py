"""Operator commands: ``outbox ops``, ``outbox approvals`` and ``outbox stats``.

What a person on call needs: which operations are stuck and why, the evidence of one
operation, a way to settle an escalation with their name and evidence on it, the
approvals waiting for them, and the numbers. An operation's input (its intent) is
printed only where a person must judge it: ``ops show`` and ``approvals pending``.
Listings and stats are built from queries that never select it, and it is never logged.

Run ids, names, reasons, error text and inputs were chosen by agents, providers or other
people: in human-readable output every one goes through :func:`printable`, so none can
move the cursor, rewrite a line or recolour the terminal. ``--json`` output is escaped
by JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg

from outbox import store
from outbox.bounds import is_unreadable, unreadable_reason
from outbox.cli.arguments import positive_int
from outbox.connections import command_parameters
from outbox.decisions import grant_approval
from outbox.errors import (
    ConfigurationError,
    IllegalTransition,
    OperationNotFound,
    ServiceUnavailable,
    connect_failure,
)
from outbox.fingerprint_key import keyed_fingerprint
from outbox.models import (
    ApprovalCheck,
    ApprovalDecision,
    ApprovalStatus,
    Callback,
    Operation,
    OperationEvent,
    display_operation_id,
    parse_operation_id,
)
from outbox.settings import Settings, redact_url
from outbox.states import OperationState, legal_targets
from outbox.store import ChainReport, OperationStats, OperationSummary, Store
from outbox.store.evidence import REASONS
from outbox.text import logfmt_key, logfmt_value, printable

S = OperationState
DEFAULT_LIST_LIMIT = 50
DEFAULT_APPROVAL_TTL = timedelta(minutes=15)
# A denial never lapses in the consumer's eyes (a denied latest decision refuses the
# effect whatever its expiry); the expiry only has to satisfy the approvals table.
_DENIAL_TTL = timedelta(minutes=15)
# Far beyond any sensible grant or look-back; it keeps `now() ± duration` inside what
# Python and Postgres timestamps can hold.
MAX_DURATION = timedelta(days=3650)
_DURATION = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}

# Resolution flag -> (decision recorded in the event, state it moves the operation to).
_RESOLUTIONS = {
    "committed": ("committed", S.COMMITTED),
    "not_committed": ("not_committed", S.PREPARED),
    "rejected": ("rejected", S.REJECTED),
}


# --- argument types ------------------------------------------------------------------


def duration(text: str) -> timedelta:
    """argparse type: ``30s``, ``15m``, ``2h``, ``1d``."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration like 30s, 15m, 2h or 1d: {text!r}")
    try:
        value = timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    except OverflowError:
        value = timedelta.max
    if value <= timedelta(0):
        raise argparse.ArgumentTypeError("a duration must be longer than zero")
    if value > MAX_DURATION:
        raise argparse.ArgumentTypeError(f"a duration must be at most {MAX_DURATION.days}d")
    return value


def since(text: str) -> datetime | timedelta:
    """argparse type for ``--since``: a duration back from now, or an ISO 8601 instant
    (UTC when it names no offset)."""
    if _DURATION.fullmatch(text):
        return duration(text)
    try:
        instant = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time or a duration like 30m, 2h, 1d: {text!r}"
        ) from None
    return instant if instant.tzinfo else instant.replace(tzinfo=UTC)


def _operation_id(text: str) -> UUID:
    try:
        return parse_operation_id(text.strip())
    except ValueError:
        raise OperationNotFound(
            f"{text!r} is not an operation id: expected op_<uuid> or a bare uuid"
        ) from None


def operation_id_argument(text: str) -> UUID:
    """argparse type for an operation id: a malformed one is a usage error (exit 2)."""
    try:
        return parse_operation_id(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an operation id: {text!r} (expected op_<uuid> or a bare uuid)"
        ) from None


def _person(text: str) -> str:
    if not text.strip():
        raise ConfigurationError("--by must name the person deciding")
    return text.strip()


# --- formatting ----------------------------------------------------------------------


def stamp(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def summary_json(summary: OperationSummary, key: str) -> dict[str, Any]:
    """One operation in ``--json`` listings: metadata only, never the input. The
    fingerprint is the keyed short form logs and events show, and nothing else."""
    return {
        "id": display_operation_id(summary.id),
        "run_id": summary.run_id,
        "tool": summary.tool_name,
        "tool_version": summary.tool_version,
        "side_effect": summary.side_effect,
        "state": str(summary.state),
        "attempts": summary.attempts,
        "reconcile_attempts": summary.reconcile_attempts,
        "last_error_class": summary.last_error_class,
        "provider_reference": summary.provider_reference,
        "requires_approval": summary.requires_approval,
        "fingerprint": keyed_fingerprint(key, summary.input_fingerprint),
        "created_at": stamp(summary.created_at),
        "updated_at": stamp(summary.updated_at),
    }


def listing_text(summaries: Sequence[OperationSummary]) -> str:
    if not summaries:
        return "no operations match"
    rows = [
        [
            display_operation_id(s.id),
            f"{s.tool_name} v{s.tool_version}",
            str(s.state),
            str(s.attempts),
            str(s.reconcile_attempts),
            s.last_error_class or "-",
            stamp(s.updated_at),
        ]
        for s in summaries
    ]
    headers = ["ID", "TOOL", "STATE", "ATTEMPTS", "RECONCILES", "LAST ERROR", "UPDATED"]
    return table(headers, rows)


def _attributes_text(name: str, attributes: dict[str, Any]) -> str:
    if is_unreadable(attributes):
        return f"(attributes unreadable: {unreadable_text(attributes)})"
    # from/to first (the move), then the rest in a stable order. Keys are quoted like
    # values when they are not plain words: a key is chosen by whoever wrote the event.
    keys: list[str] = [k for k in ("from", "to") if k in attributes]
    keys += sorted(k for k in attributes if k not in ("from", "to"))
    text = printable(
        " ".join(f"{logfmt_key(key)}={logfmt_value(_scalar(attributes[key]))}" for key in keys)
    )
    # The agent's own event: its words, not the runtime's record of what happened.
    return f"the agent says: {text}" if name.startswith("agent.") else text


def unreadable_text(value: object) -> str:
    """What a reader shows for a stored value it would not parse: why, and its size."""
    assert isinstance(value, dict)
    detail = value.get("outbox.unreadable")
    size = detail.get("bytes") if isinstance(detail, dict) else None
    return f"{unreadable_reason(value)}, {size} bytes" if size else str(unreadable_reason(value))


def intent_text(tool_input: dict[str, Any]) -> str:
    """The validated input as one line of JSON (keys sorted), safe for a terminal; what
    a person approves or settles, never a summary of it."""
    if is_unreadable(tool_input):
        return f"(unreadable: {unreadable_text(tool_input)}; it is never executed)"
    return printable(json.dumps(tool_input, ensure_ascii=False, sort_keys=True))


def _scalar(value: Any) -> str | int | float | bool | None:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, sort_keys=True)


def callbacks_text(callbacks: Sequence[Callback]) -> str:
    """An operation's callbacks, in the order they came: what each reported, and what
    the reconciler did with it. Every field a provider chose is escaped."""
    head = f"callbacks ({len(callbacks)})"
    if not callbacks:
        return head
    rows = [
        [
            str(c.id),
            c.provider,
            c.event_id,
            str(c.status),
            c.provider_reference or "-",
            str(c.outcome) if c.outcome else "not applied yet",
            stamp(c.received_at),
        ]
        for c in callbacks
    ]
    headers = ["ID", "PROVIDER", "EVENT", "STATUS", "REFERENCE", "OUTCOME", "RECEIVED"]
    return "\n".join([head, *("  " + line for line in table(headers, rows).splitlines())])


def show_text(
    operation: Operation,
    events: Sequence[OperationEvent],
    approval: str | None,
    key: str,
    callbacks: Sequence[Callback] = (),
) -> str:
    header = [
        ("operation", operation.display_id),
        ("run", operation.run_id),
        ("tool", f"{operation.tool_name} v{operation.tool_version}"),
        ("side effect", str(operation.side_effect)),
        ("state", str(operation.state)),
        ("fingerprint", keyed_fingerprint(key, operation.input_fingerprint)),
        ("input", intent_text(operation.input)),
        ("attempts", str(operation.attempts)),
        ("reconciles", str(operation.reconcile_attempts)),
        ("provider ref", operation.provider_reference or "-"),
        ("last error", operation.last_error_class or "-"),
        ("approval", approval or "not required"),
        ("created", stamp(operation.created_at)),
        ("updated", stamp(operation.updated_at)),
    ]
    width = max(len(label) for label, _ in header)
    lines = [f"{label.ljust(width)}  {printable(value)}" for label, value in header]
    lines += ["", f"timeline ({len(events)} events)"]
    names = [printable(event.name) for event in events]
    name_width = max(map(len, names), default=0)
    for event, name in zip(events, names, strict=True):
        when, name = stamp(event.created_at), name.ljust(name_width)
        text = _attributes_text(event.name, event.attributes)
        lines.append(f"  {when}  {name}  {text}".rstrip())
    lines += ["", callbacks_text(callbacks)]
    return "\n".join(lines)


def chain_json(report: ChainReport) -> dict[str, Any]:
    return {
        "intact": report.intact,
        "operations_checked": report.operations_checked,
        "events_checked": report.events_checked,
        "broken": [
            {
                "operation_id": display_operation_id(link.operation_id),
                "event_id": link.event_id,
                "reason": link.reason,
            }
            for link in report.broken
        ],
    }


def chain_text(report: ChainReport, operation_id: UUID | None) -> str:
    """One line with the verdict, then a row per broken link with what it means."""
    if operation_id is not None:
        head = f"{display_operation_id(operation_id)} ({report.events_checked} events)"
    else:
        head = f"{report.operations_checked} operations, {report.events_checked} events"
    if report.intact:
        return f"{head}: {'evidence chain' if operation_id else 'every evidence chain'} intact"
    operations = len({link.operation_id for link in report.broken})
    verdict = f"{head}: BROKEN, {len(report.broken)} broken link(s) in {operations} operation(s)"
    rows = [
        [
            display_operation_id(link.operation_id),
            f"event {link.event_id}" if link.event_id is not None else "-",
            link.reason,
            REASONS.get(link.reason, ""),
        ]
        for link in report.broken
    ]
    table_lines = table(["OPERATION", "EVENT", "REASON", "MEANING"], rows).splitlines()
    return "\n".join([verdict, *("  " + line for line in table_lines)])


def approval_text(check: ApprovalCheck, decided_by: str | None = None) -> str:
    """The approval check in a line; with the name an operator may read, who decided."""
    reason = check.reason
    if decided_by is not None and check.approval is not None:
        if check.status is ApprovalStatus.DENIED:
            reason = f"denied by {decided_by}"
        elif check.status is ApprovalStatus.VALID:
            reason = f"granted by {decided_by} until {stamp(check.approval.expires_at)}"
    return f"{check.status}: {reason}"


# --- database ------------------------------------------------------------------------


@contextlib.contextmanager
def _connect(settings: Settings) -> Iterator[psycopg.Connection[Any]]:
    """One transaction per command: committed when the command succeeds."""
    url = settings.libpq_url
    try:
        connection = psycopg.connect(url, **command_parameters(settings))
    except psycopg.OperationalError as failure:
        # libpq's message may echo connection parameters: the cause is named in our words.
        raise ServiceUnavailable(
            f"could not connect to Postgres at {redact_url(url)}: {connect_failure(failure)}"
        ) from None
    with connection:
        yield connection


# --- handlers ------------------------------------------------------------------------


def cmd_ops_list(args: argparse.Namespace, settings: Settings) -> int:
    window = args.since
    with _connect(settings) as connection:
        key = Store(connection).run(store.fingerprint_key())
        summaries = Store(connection).run(
            store.list_operation_summaries(
                states=[S(state) for state in args.states] if args.states else None,
                tool=args.tool,
                since=window if isinstance(window, datetime) else None,
                within=window if isinstance(window, timedelta) else None,
                limit=args.limit,
            )
        )
    if args.json:
        print(json.dumps([summary_json(s, key) for s in summaries], indent=2))
    else:
        print(listing_text(summaries))
    return 0


def cmd_ops_show(args: argparse.Namespace, settings: Settings) -> int:
    operation_id = _operation_id(args.operation_id)
    with _connect(settings) as connection:
        runner = Store(connection)
        key = runner.run(store.fingerprint_key())
        operation = runner.run(store.get_operation(operation_id))
        events = runner.run(store.events(operation_id))
        callbacks = runner.run(store.callbacks_of([operation_id])).get(operation_id, [])
        approval = None
        if operation.requires_approval:
            check = runner.run(store.check_approval(operation_id))
            approval = approval_text(check, runner.run(store.approver_of(check)))
    print(show_text(operation, events, approval, key, callbacks))
    return 0


def cmd_ops_verify(args: argparse.Namespace, settings: Settings) -> int:
    """Exit 0 when every chain checked is intact, 1 when a link is broken, 2 when the
    operation named does not exist (nothing was checked)."""
    operation_id: UUID | None = args.operation_id
    with _connect(settings) as connection:
        report = Store(connection).run(store.verify_chain(operation_id))
    if operation_id is not None and report.operations_checked == 0:
        print(
            f"outbox ops verify: {display_operation_id(operation_id)} is not an operation of "
            "this database; nothing was checked",
            file=sys.stderr,
        )
        return 2
    print(
        json.dumps(chain_json(report), indent=2) if args.json else chain_text(report, operation_id)
    )
    return 0 if report.intact else 1


def _resolvable(operation: Operation, force: bool) -> None:
    """Only a person's escalation is theirs to settle; an unknown outcome is the
    reconciler's until they say otherwise (--force)."""
    if operation.state is S.ESCALATED:
        return
    if operation.state is S.OUTCOME_UNKNOWN:
        if force:
            return
        raise IllegalTransition(
            f"{operation.display_id} is outcome_unknown: the reconciler is still settling it. "
            "Resolve it yourself only with evidence of the outcome, and --force; nothing "
            "was changed"
        )
    targets = ", ".join(legal_targets(operation.state)) or "nowhere (terminal)"
    raise IllegalTransition(
        f"{operation.display_id} is {operation.state}: only an escalated operation can be "
        f"resolved (or an outcome_unknown one, with --force). From {operation.state} the "
        f"state machine allows: {targets}; nothing was changed"
    )


def cmd_ops_resolve(args: argparse.Namespace, settings: Settings) -> int:
    operation_id = _operation_id(args.operation_id)
    decision, target = _RESOLUTIONS[args.resolution]
    if target is S.COMMITTED and not args.provider_ref:
        raise ConfigurationError(
            "--committed needs --provider-ref: the provider's id of the effect"
        )
    if target is not S.COMMITTED and args.provider_ref:
        raise ConfigurationError("--provider-ref goes with --committed only")
    if not args.evidence.strip():
        raise ConfigurationError("--evidence must say what the decision rests on")
    person = _person(args.by)
    with _connect(settings) as connection:
        runner = Store(connection)
        current = runner.run(store.get_operation(operation_id))
        _resolvable(current, args.force)
        resolved = runner.run(
            store.resolve_operation(
                operation_id,
                source=current.state,
                target=target,
                decision=decision,
                resolved_by=person,
                evidence=args.evidence.strip(),
                provider_reference=args.provider_ref,
            )
        )
    outcome = {
        S.COMMITTED: f"committed, provider reference {resolved.provider_reference}",
        S.PREPARED: "prepared: one more attempt is queued now, under the same idempotency key",
        S.REJECTED: "rejected: it will not be attempted again",
    }[target]
    print(f"{resolved.display_id}: {current.state} -> {printable(outcome)}")
    print(f"resolved by {printable(person)}; the evidence is kept in its operation.resolved event")
    return 0


def cmd_ops_cancel(args: argparse.Namespace, settings: Settings) -> int:
    """End a prepared operation as rejected before it is ever attempted."""
    operation_id = _operation_id(args.operation_id)
    if not args.reason.strip():
        raise ConfigurationError("--reason must say why the operation is cancelled")
    person = _person(args.by)
    with _connect(settings) as connection:
        runner = Store(connection)
        current = runner.run(store.get_operation(operation_id))
        if current.state is not S.PREPARED:
            raise IllegalTransition(
                f"{current.display_id} is {current.state}: only a prepared operation, which "
                "no worker holds, can be cancelled (an escalated one is resolved with "
                "`outbox ops resolve --rejected`); nothing was changed"
            )
        cancelled = runner.run(
            store.resolve_operation(
                operation_id,
                source=S.PREPARED,
                target=S.REJECTED,
                decision="cancel",
                resolved_by=person,
                evidence=args.reason.strip(),
            )
        )
    print(f"{cancelled.display_id}: prepared -> rejected: it will not be attempted")
    print(f"cancelled by {printable(person)}; the reason is kept in its operation.resolved event")
    return 0


def cmd_approvals_pending(args: argparse.Namespace, settings: Settings) -> int:
    with _connect(settings) as connection:
        runner = Store(connection)
        key = runner.run(store.fingerprint_key())
        pending = runner.run(store.pending_approvals())
        # An approver judges the intent itself, not its fingerprint. The listing query
        # leaves the input out, so it is read per operation, in the same transaction.
        inputs = {
            p.operation.id: runner.run(store.get_operation(p.operation.id)).input for p in pending
        }
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **summary_json(p.operation, key),
                        "input": inputs[p.operation.id],
                        "approval_status": str(p.check.status),
                        "approval_reason": p.check.reason,
                    }
                    for p in pending
                ],
                indent=2,
            )
        )
        return 0
    if not pending:
        print("no operations are waiting for an approval")
        return 0
    rows = [
        [
            display_operation_id(p.operation.id),
            f"{p.operation.tool_name} v{p.operation.tool_version}",
            keyed_fingerprint(key, p.operation.input_fingerprint),
            f"{p.operation.side_effect} in run {p.operation.run_id}",
            approval_text(p.check, p.decided_by),
            stamp(p.operation.created_at),
            # Last: the one column of any length.
            intent_text(inputs[p.operation.id]),
        ]
        for p in pending
    ]
    headers = ["ID", "TOOL", "FINGERPRINT", "SUMMARY", "APPROVAL", "CREATED", "INPUT"]
    print(table(headers, rows))
    return 0


def _approvable(operation: Operation) -> None:
    if operation.state.is_terminal:
        raise IllegalTransition(
            f"{operation.display_id} is {operation.state}: there is nothing left to decide"
        )


def cmd_approvals_grant(args: argparse.Namespace, settings: Settings) -> int:
    operation_id = _operation_id(args.operation_id)
    person = _person(args.by)
    with _connect(settings) as connection:
        key = Store(connection).run(store.fingerprint_key())
        operation = Store(connection).run(store.get_operation(operation_id))
        _approvable(operation)
        approval = grant_approval(connection, operation_id, approved_by=person, ttl=args.ttl)
    print(
        f"approval {approval.id} granted by {printable(person)} for {operation.display_id} "
        f"(intent {keyed_fingerprint(key, approval.intent_hash)}), expires "
        f"{stamp(approval.expires_at)}"
    )
    if operation.state is S.PREPARED:
        print("the operation is queued again and will be attempted under this grant")
    if not operation.requires_approval:
        print("note: this operation did not require an approval")
    return 0


def cmd_approvals_deny(args: argparse.Namespace, settings: Settings) -> int:
    operation_id = _operation_id(args.operation_id)
    person = _person(args.by)
    with _connect(settings) as connection:
        operation = Store(connection).run(store.get_operation(operation_id))
        _approvable(operation)
        approval = Store(connection).run(
            store.decide_approval(
                operation_id,
                decision=ApprovalDecision.DENIED,
                approved_by=person,
                ttl=_DENIAL_TTL,
            )
        )
    print(f"approval {approval.id}: denied by {printable(person)} for {operation.display_id}")
    print(
        f"the operation stays {operation.state} for now: the consumer refuses to execute "
        "it while this denial is its latest approval decision, a later grant supersedes "
        "it, and with no grant the consumer ends it rejected (approval_denied) after "
        "OUTBOX_APPROVAL_DENIAL_GRACE"
    )
    return 0


def stats_json(stats: OperationStats) -> dict[str, Any]:
    by_state = dict.fromkeys((str(s) for s in S), 0)
    for states in stats.by_tool.values():
        for state, count in states.items():
            by_state[state] += count
    return {
        "by_state": by_state,
        "by_tool": {
            tool: {str(s): states.get(str(s), 0) for s in S}
            for tool, states in sorted(stats.by_tool.items())
        },
        "outbox_backlog": stats.backlog.pending,
        "oldest_pending_age_seconds": round(stats.backlog.oldest_age_seconds, 3),
        "escalations_waiting": by_state[str(S.ESCALATED)],
        "approvals_waiting": stats.pending_approvals,
    }


def stats_text(numbers: dict[str, Any]) -> str:
    states = [str(s) for s in S]
    rows = [
        [tool, *(str(counts[s]) for s in states), str(sum(counts.values()))]
        for tool, counts in numbers["by_tool"].items()
    ]
    rows.append(
        [
            "all",
            *(str(numbers["by_state"][s]) for s in states),
            str(sum(numbers["by_state"].values())),
        ]
    )
    lines = [
        table(["TOOL", *(s.upper() for s in states), "TOTAL"], rows),
        "",
        f"outbox backlog       {numbers['outbox_backlog']} unpublished row(s), oldest waiting "
        f"{numbers['oldest_pending_age_seconds']:.1f} s",
        f"escalations waiting  {numbers['escalations_waiting']}  "
        "(outbox ops list --state escalated)",
        f"approvals waiting    {numbers['approvals_waiting']}  (outbox approvals pending)",
    ]
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace, settings: Settings) -> int:
    with _connect(settings) as connection:
        stats = Store(connection).run(store.operation_stats())
    numbers = stats_json(stats)
    print(json.dumps(numbers, indent=2) if args.json else stats_text(numbers))
    return 0


# --- parsers -------------------------------------------------------------------------


def add_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    add_setting_flags: Callable[..., None],
) -> None:
    """Register ``ops``, ``approvals`` and ``stats`` on the ``outbox`` command.

    ``add_setting_flags`` is passed in by the CLI, which imports this module."""

    def leaf(
        parent: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        handler: Callable[[argparse.Namespace, Settings], int],
        help_text: str,
        description: str,
    ) -> argparse.ArgumentParser:
        parser = parent.add_parser(name, help=help_text, description=description)
        add_setting_flags(parser, "database_url")
        parser.set_defaults(handler=handler)
        return parser

    ops_parser = commands.add_parser(
        "ops",
        help="list operations, show one's evidence, resolve an escalation",
        description="Look at operations and settle the ones handed to a person. Only "
        "`ops show` prints an operation's input.",
    )
    ops = ops_parser.add_subparsers(dest="ops_command", required=True, metavar="ACTION")

    listing = leaf(
        ops,
        "list",
        cmd_ops_list,
        "operations, most recently changed first",
        "One line per operation: id, tool and version, state, attempts, reconciliation "
        "lookups, last error class and last change, most recently changed first.",
    )
    listing.add_argument(
        "--state",
        dest="states",
        action="append",
        choices=[str(s) for s in S],
        help="only operations in this state (repeatable)",
    )
    listing.add_argument("--tool", help="only operations of this tool")
    listing.add_argument(
        "--since",
        type=since,
        help="only operations changed since then: an ISO 8601 time (UTC unless it has an "
        "offset) or a duration back from now, like 30m, 2h, 1d",
    )
    listing.add_argument(
        "--limit",
        type=positive_int,
        default=DEFAULT_LIST_LIMIT,
        help=f"show at most N operations (default {DEFAULT_LIST_LIMIT})",
    )
    listing.add_argument("--json", action="store_true", help="a JSON list instead of a table")

    show = leaf(
        ops,
        "show",
        cmd_ops_show,
        "one operation and its lifecycle timeline",
        "The operation's identity, tool, state, counters, provider reference and approval "
        "status, the validated input (JSON, control characters escaped), then every "
        "lifecycle event with its time and attributes, then every provider callback about "
        "it and what was done with it.",
    )
    show.add_argument("operation_id", metavar="OP_ID", help="op_<uuid> or a bare uuid")

    verify = leaf(
        ops,
        "verify",
        cmd_ops_verify,
        "check that lifecycle events are the ones written (one operation, or --all)",
        "Recompute the hash chain of an operation's lifecycle events and compare it with "
        "the chain's head: reports every event changed, deleted or added around the "
        'database\'s chain trigger (docs/operating.md, "The evidence chain"). Exit '
        "status 0 when intact, 1 when a link is broken, 2 for an operation id that is "
        "malformed or unknown.",
    )
    target = verify.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "operation_id",
        metavar="OP_ID",
        nargs="?",
        type=operation_id_argument,
        help="op_<uuid> or a bare uuid",
    )
    target.add_argument(
        "--all",
        dest="all_operations",
        action="store_true",
        help="every operation, page by page",
    )
    verify.add_argument("--json", action="store_true", help="one JSON document instead of text")

    resolve = leaf(
        ops,
        "resolve",
        cmd_ops_resolve,
        "settle an escalated operation, with your name and evidence",
        "Settle an escalated operation after finding out what happened: --committed (the "
        "effect happened: give the provider's reference), --not-committed (it provably did "
        "not: one more attempt is queued, under the same idempotency key) or --rejected "
        "(do not do it). Recorded as an operation.resolved event with your name, decision "
        "and evidence; the evidence is stored there (first 500 characters), never logged.",
    )
    resolve.add_argument("operation_id", metavar="OP_ID", help="op_<uuid> or a bare uuid")
    decision = resolve.add_mutually_exclusive_group(required=True)
    decision.add_argument(
        "--committed",
        dest="resolution",
        action="store_const",
        const="committed",
        help="the effect happened (needs --provider-ref)",
    )
    decision.add_argument(
        "--not-committed",
        dest="resolution",
        action="store_const",
        const="not_committed",
        help="the effect provably did not happen: attempt it once more",
    )
    decision.add_argument(
        "--rejected",
        dest="resolution",
        action="store_const",
        const="rejected",
        help="the effect must not happen: end the operation",
    )
    resolve.add_argument("--provider-ref", help="the provider's id of the effect (--committed)")
    resolve.add_argument(
        "--evidence", required=True, help="what the decision rests on (kept with the operation)"
    )
    resolve.add_argument("--by", required=True, help="who decides (name or email)")
    resolve.add_argument(
        "--force",
        action="store_true",
        help="also resolve an outcome_unknown operation the reconciler has not escalated yet "
        "(a reconciler's later write on it is then refused)",
    )

    cancel = leaf(
        ops,
        "cancel",
        cmd_ops_cancel,
        "end a prepared operation as rejected, before any attempt",
        "Cancel an operation that no worker has attempted yet (state prepared): it ends "
        "rejected and is never executed. A worker that claims it first wins, and the "
        "cancel is refused with nothing changed. Recorded as an operation.resolved event "
        "(decision cancel) with your name and reason; the reason is stored there, never "
        "logged.",
    )
    cancel.add_argument("operation_id", metavar="OP_ID", help="op_<uuid> or a bare uuid")
    cancel.add_argument(
        "--reason", required=True, help="why it must not happen (kept with the operation)"
    )
    cancel.add_argument("--by", required=True, help="who decides (name or email)")

    approvals_parser = commands.add_parser(
        "approvals",
        help="operations waiting for an approval; grant or deny one",
        description="A grant binds one operation and the exact intent (fingerprint) it "
        "has now; a changed intent needs a new grant.",
    )
    approvals = approvals_parser.add_subparsers(
        dest="approvals_command", required=True, metavar="ACTION"
    )
    pending = leaf(
        approvals,
        "pending",
        cmd_approvals_pending,
        "prepared operations that need an approval and have no valid one",
        "Prepared operations whose contract requires an approval and whose latest approval "
        "is missing, expired, denied or for another intent, oldest first, each with the "
        "validated input a grant would approve (JSON, control characters escaped).",
    )
    pending.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    grant = leaf(
        approvals,
        "grant",
        cmd_approvals_grant,
        "approve one operation's current intent, for a while",
        "Write a grant bound to the operation's fingerprint, valid for --ttl, and queue the "
        "operation again. Prints the approval id and its expiry.",
    )
    grant.add_argument("operation_id", metavar="OP_ID", help="op_<uuid> or a bare uuid")
    grant.add_argument("--by", required=True, help="who approves (name or email)")
    grant.add_argument(
        "--ttl",
        type=duration,
        default=DEFAULT_APPROVAL_TTL,
        help="how long the grant stays valid: 30s, 15m, 2h, 1d (default 15m)",
    )
    deny = leaf(
        approvals,
        "deny",
        cmd_approvals_deny,
        "refuse one operation: the consumer will not execute it",
        "Record a denial. The consumer refuses to execute the operation while the denial "
        "is its latest decision; a later grant supersedes it, and with no grant the "
        "operation ends rejected (approval_denied) after OUTBOX_APPROVAL_DENIAL_GRACE.",
    )
    deny.add_argument("operation_id", metavar="OP_ID", help="op_<uuid> or a bare uuid")
    deny.add_argument("--by", required=True, help="who denies (name or email)")

    stats = leaf(
        commands,
        "stats",
        cmd_stats,
        "operations by state and tool, outbox backlog, what waits for a person",
        "Counts of operations by tool and state, unpublished outbox rows and the age of "
        "the oldest, escalations and approvals waiting for a person.",
    )
    stats.add_argument("--json", action="store_true", help="one JSON document instead of text")
