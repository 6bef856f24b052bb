"""``outbox ops``, ``outbox approvals``, ``outbox stats`` and ``outbox providers``: the
handlers and their parsers, one ``configure_*`` per command group (``outbox dlq`` is
:mod:`outbox.operator.dlq_commands`, ``outbox callbacks list``
:mod:`outbox.operator.callbacks_commands`).

What a person on call needs: which operations are stuck and why, the evidence of one
operation, a way to settle an escalation with their name and evidence on it, the
approvals waiting for them, the numbers, and which providers are down. The rules and
the writes are :mod:`outbox.operator.rules` (the console uses the same), the output is
:mod:`outbox.operator.render`; each command runs in one transaction
(:func:`outbox.connections.command_transaction`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TypeAlias

from outbox import store
from outbox.bounds import MAX_APPROVAL_TTL
from outbox.cli.arguments import (
    add_setting_flags,
    add_tools_flag,
    duration,
    positive_int,
    positive_int_up_to,
    since,
)
from outbox.cli.run import EXIT_FAILED, print_json
from outbox.connections import command_transaction
from outbox.contracts import Registry
from outbox.errors import ConfigurationError
from outbox.loading import registry_from
from outbox.models import ApprovalDecision
from outbox.operator import (
    archived,
    one_operation,
    render,
    render_providers,
    rules,
    timeline,
    views,
)
from outbox.operator.batch_commands import add_batch_flags, is_batch, resolve_many
from outbox.operator.history_commands import add_verify_targets, cmd_ops_verify
from outbox.operator.input import DEFAULT_APPROVAL_TTL, MAX_TYPED_REFERENCE
from outbox.operator.rules import Resolution
from outbox.settings import Settings
from outbox.states import OperationState
from outbox.store import Store
from outbox.text import printable

S = OperationState
Handler = Callable[[argparse.Namespace, Settings], int]
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

DEFAULT_LIST_LIMIT = 50
DEFAULT_EVENTS_LIMIT = 20
MAX_EVENTS_LIMIT = 1000
OP_ID_HELP = "op_<uuid>, a bare uuid, or the short id the console shows (op_74ca7733)"


def _person(text: str) -> str:
    if not text.strip():
        raise ConfigurationError("--by must name the person deciding")
    return text.strip()


def _minutes(lifetime: timedelta) -> str:
    return f"{int(lifetime.total_seconds() // 60)}m"


def _registry(settings: Settings) -> Registry | None:
    return registry_from(settings, required=False)


def cmd_ops_list(args: argparse.Namespace, settings: Settings) -> int:
    window = args.since
    where = {
        "states": [S(state) for state in args.states] if args.states else None,
        "tool": args.tool,
        "since": window if isinstance(window, datetime) else None,
        "within": window if isinstance(window, timedelta) else None,
        "limit": args.limit,
    }
    with command_transaction(settings) as connection:
        runner = Store(connection)
        key = runner.run(store.fingerprint_key())
        summaries = runner.run(store.list_operation_summaries(**where))
        moved = archived.listing(runner, summaries, **where) if args.archived else None
        summaries = moved.summaries if moved else summaries
        escalations = views.escalations(runner, ((s.id, s.state) for s in summaries))
    now = datetime.now(UTC)
    archived_at = moved.archived_at if moved else None
    if args.json:
        print_json(
            [
                render.summary_json(s, key, render.escalation_json(escalations.get(s.id), now))
                | (
                    {}
                    if archived_at is None
                    else {"archived_at": render.instant(archived_at.get(s.id))}
                )
                for s in summaries
            ]
        )
    else:
        # A list of escalations says why each one waits, and for how long.
        only_escalated = bool(args.states) and set(args.states) == {str(S.ESCALATED)}
        shown = escalations if only_escalated else None
        print(render.listing_text(summaries, shown, now, archived_at))
    return 0


def cmd_ops_show(args: argparse.Namespace, settings: Settings) -> int:
    with command_transaction(settings) as connection:
        runner = Store(connection)
        operation_id = views.operation_id_of(runner, args.operation_id)
        key = runner.run(store.fingerprint_key())
        operation = runner.run(store.find_operation(operation_id))
        if operation is None:  # moved to history, or never there
            return archived.show(runner, operation_id, args)
        page = runner.run(
            store.events_page(
                operation_id, after_id=args.after, before_id=args.before, limit=args.events
            )
        )
        callbacks = runner.run(store.callbacks_of([operation_id])).get(operation_id, [])
        check = decided_by = None
        if operation.requires_approval:
            check = runner.run(store.check_approval(operation_id))
            decided_by = runner.run(store.approver_of(check))
    if args.json:
        print_json(one_operation.show_json(operation, page, check, decided_by, key, callbacks))
        return 0
    approval = render.approval_text(check, decided_by) if check is not None else None
    print(one_operation.show_text(operation, page, approval, key, callbacks))
    return 0


def cmd_ops_resolve(args: argparse.Namespace, settings: Settings) -> int:
    resolution = Resolution(args.resolution)
    person = _person(args.by)
    # Only a retry asks the contract (its dedupe window); the other two never load tools.
    registry = _registry(settings) if resolution is Resolution.NOT_COMMITTED else None
    if is_batch(args):
        return resolve_many(args, settings, resolution, person, registry)
    with command_transaction(settings) as connection:
        runner = Store(connection)
        resolved = rules.resolve(
            runner,
            views.operation_id_of(runner, args.operation_id),
            resolution,
            by=person,
            evidence=args.evidence,
            provider_reference=args.provider_ref,
            force=args.force,
            registry=registry,
        )
    print(render.resolved_text(resolved, person))
    return 0


def cmd_ops_cancel(args: argparse.Namespace, settings: Settings) -> int:
    """End a prepared operation as rejected before it is ever attempted."""
    person = _person(args.by)
    with command_transaction(settings) as connection:
        runner = Store(connection)
        cancelled = rules.cancel(
            runner,
            views.operation_id_of(runner, args.operation_id),
            by=person,
            reason=args.reason,
        )
    print(f"{cancelled.display_id}: prepared -> rejected: it will not be attempted")
    print(f"cancelled by {printable(person)}; the reason is kept in its operation.resolved event")
    return 0


def cmd_approvals_pending(args: argparse.Namespace, settings: Settings) -> int:
    with command_transaction(settings) as connection:
        runner = Store(connection)
        key = runner.run(store.fingerprint_key())
        pending = runner.run(store.pending_approvals())
        # An approver judges the intent itself, not its fingerprint. The listing query
        # leaves the input out, so it is read per operation, in the same transaction.
        inputs = {
            p.operation.id: runner.run(store.get_operation(p.operation.id)).input for p in pending
        }
    if args.json:
        print_json([render.pending_json(p, key, inputs[p.operation.id]) for p in pending])
    else:
        print(render.pending_text(pending, key, inputs))
    return 0


def _decide(args: argparse.Namespace, settings: Settings, decision: ApprovalDecision) -> int:
    person = _person(args.by)
    with command_transaction(settings) as connection:
        runner = Store(connection)
        decided = rules.decide_approval(
            runner,
            views.operation_id_of(runner, args.operation_id),
            decision,
            by=person,
            ttl=args.ttl,
            shown=args.intent,
        )
    if getattr(args, "json", False):
        print_json(render.approval_decided_json(decided))
    else:
        print(render.approval_decided_text(decided))
    return 0


def cmd_approvals_grant(args: argparse.Namespace, settings: Settings) -> int:
    return _decide(args, settings, ApprovalDecision.GRANTED)


def cmd_approvals_deny(args: argparse.Namespace, settings: Settings) -> int:
    return _decide(args, settings, ApprovalDecision.DENIED)


def cmd_stats(args: argparse.Namespace, settings: Settings) -> int:
    with command_transaction(settings) as connection:
        stats = Store(connection).run(store.operation_stats())
    numbers = render.stats_json(stats)
    if args.json:
        print_json(numbers)
    else:
        print(render.stats_text(numbers))
    return 0


def cmd_providers(args: argparse.Namespace, settings: Settings) -> int:
    """Exit 0 with the breakers (or one provider's outages); 1, with nothing printed on
    stdout, for ``--events`` of a provider that has neither a row nor an event."""
    if args.limit is not None and args.events is None:
        raise ConfigurationError("--limit goes with --events only")
    registry = _registry(settings)
    wanted: str | None = args.events
    limit: int = args.limit or DEFAULT_EVENTS_LIMIT
    with command_transaction(settings) as connection:
        connection.read_only = True
        runner = Store(connection)
        providers = views.provider_views(runner, registry)
        events = [] if wanted is None else runner.run(store.provider_events(wanted, limit=limit))
    if wanted is None:
        if args.json:
            print_json(render_providers.providers_json(providers))
        else:
            print(render_providers.providers_text(providers))
        return 0
    view = providers.named(wanted)
    if view is None and not events:
        known = ", ".join(p.health.provider for p in providers.providers) or "none"
        print(
            f"outbox providers: {printable(repr(wanted))} has no breaker row and no outage "
            f"event in this database: it has never failed, or it is not a provider's name "
            f"(providers with a row: {known})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if args.json:
        print_json(render_providers.provider_events_json(wanted, view, events))
    else:
        print(render_providers.provider_events_text(wanted, view, events, limit))
    return 0


def _event_cursor(text: str) -> int:
    try:
        return timeline.event_cursor(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _leaf(
    parent: Commands,
    name: str,
    handler: Handler,
    help_text: str,
    description: str,
) -> argparse.ArgumentParser:
    parser = parent.add_parser(name, help=help_text, description=description)
    add_setting_flags(parser, "database_url")
    parser.set_defaults(handler=handler)
    return parser


def _json_flag(
    parser: argparse.ArgumentParser, what: str = "a JSON list instead of a table"
) -> None:
    parser.add_argument("--json", action="store_true", help=what)


def configure_ops(commands: Commands) -> None:
    """Register ``outbox ops`` (list, show, verify, resolve, cancel)."""
    parser = commands.add_parser(
        "ops",
        help="list operations, show one's evidence, resolve an escalation",
        description="Look at operations and settle the ones handed to a person. Only "
        "`ops show` prints an operation's input.",
    )
    ops = parser.add_subparsers(dest="ops_command", required=True, metavar="ACTION")

    listing = _leaf(
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
    listing.add_argument(
        "--archived",
        action="store_true",
        help="also operations moved to history (OUTBOX_HISTORY_HOT after they settled), "
        "newest first, under the same --limit; an ARCHIVED column says when each moved",
    )
    _json_flag(listing)

    show = _leaf(
        ops,
        "show",
        cmd_ops_show,
        "one operation and its lifecycle timeline",
        "The operation's identity, tool, state, counters, provider reference and approval "
        "status, the validated input (JSON, control characters escaped), then one page of "
        "its lifecycle events with their time and attributes (the newest, unless --after "
        "or --before names where the page starts), how many more lie on either side and "
        "the command that shows them, then every provider callback about it and what "
        "was done with it.",
    )
    show.add_argument("operation_id", metavar="OP_ID", help=OP_ID_HELP)
    show.add_argument(
        "--events",
        type=positive_int_up_to(store.MAX_EVENTS_PAGE),
        default=timeline.DEFAULT_EVENTS,
        metavar="N",
        help=f"show at most N events (default {timeline.DEFAULT_EVENTS}, at most "
        f"{store.MAX_EVENTS_PAGE})",
    )
    cursor = show.add_mutually_exclusive_group()
    cursor.add_argument(
        "--after",
        type=_event_cursor,
        metavar="EVENT_ID",
        help="the oldest events after this one (0: from the first event); the page's "
        "JSON gives the next one as `next`",
    )
    cursor.add_argument(
        "--before",
        type=_event_cursor,
        metavar="EVENT_ID",
        help="the newest events before this one; the page's JSON gives it as `previous`",
    )
    _json_flag(
        show,
        "one JSON document instead of text (the input as JSON, not escaped text), with "
        "the timeline's `events_total` and the `next` and `previous` page cursors",
    )

    verify = _leaf(
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
    add_verify_targets(verify, OP_ID_HELP)
    _json_flag(verify, "one JSON document instead of text")

    _configure_resolve(ops)

    cancel = _leaf(
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
    cancel.add_argument("operation_id", metavar="OP_ID", help=OP_ID_HELP)
    cancel.add_argument(
        "--reason", required=True, help="why it must not happen (kept with the operation)"
    )
    cancel.add_argument("--by", required=True, help="who decides (name or email)")


_RESOLUTION_HELP = {
    Resolution.COMMITTED: "the effect happened (needs --provider-ref)",
    Resolution.NOT_COMMITTED: "the effect provably did not happen: attempt it once more "
    "(a deduplicated write only inside its dedupe window, which needs --tools)",
    Resolution.REJECTED: "the effect must not happen: end the operation",
}


def _configure_resolve(ops: Commands) -> None:
    resolve = _leaf(
        ops,
        "resolve",
        cmd_ops_resolve,
        "settle an escalated operation (or many, by filter), with your name and evidence",
        "Settle an escalated operation after finding out what happened: --committed (the "
        "effect happened: give the provider's reference), --not-committed (it provably did "
        "not: one more attempt is queued, under the same idempotency key) or --rejected "
        "(do not do it). The console offers the same three, under the same rules. Recorded "
        "as an operation.resolved event with your name, decision and evidence; the "
        "evidence (1 to 500 characters) is stored there, never logged.",
    )
    resolve.add_argument("operation_id", metavar="OP_ID", nargs="?", help=OP_ID_HELP)
    decision = resolve.add_mutually_exclusive_group(required=True)
    for resolution in Resolution:
        decision.add_argument(
            resolution.flag,
            dest="resolution",
            action="store_const",
            const=str(resolution),
            help=_RESOLUTION_HELP[resolution],
        )
    resolve.add_argument(
        "--provider-ref",
        help="the provider's id of the effect (--committed): 1 to "
        f"{MAX_TYPED_REFERENCE} printable characters",
    )
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
    # A retry of a deduplicated write asks its contract whether the window still holds.
    add_tools_flag(resolve)
    add_batch_flags(resolve)


def configure_approvals(commands: Commands) -> None:
    """Register ``outbox approvals`` (pending, grant, deny)."""
    parser = commands.add_parser(
        "approvals",
        help="operations waiting for an approval; grant or deny one",
        description="A grant binds one operation and the exact intent (fingerprint) it "
        "has now; a changed intent needs a new grant.",
    )
    approvals = parser.add_subparsers(dest="approvals_command", required=True, metavar="ACTION")
    pending = _leaf(
        approvals,
        "pending",
        cmd_approvals_pending,
        "prepared operations that need an approval and have no valid one",
        "Prepared operations whose contract requires an approval and whose latest approval "
        "is missing, expired, denied or for another intent, oldest first, each with the "
        "validated input a grant would approve (JSON, control characters escaped).",
    )
    _json_flag(pending)
    intent_help = (
        "the fingerprint `approvals pending` or `ops show` printed for the intent you "
        "judged: refused, with nothing written, if the intent is no longer that one "
        "(without it, the intent read now is bound and printed)"
    )
    grant = _leaf(
        approvals,
        "grant",
        cmd_approvals_grant,
        "approve one operation's current intent, for a while",
        "Write a grant bound to the operation's fingerprint, valid for --ttl, and queue the "
        "operation again. Prints the approval id, the intent's fingerprint and the expiry.",
    )
    grant.add_argument("operation_id", metavar="OP_ID", help=OP_ID_HELP)
    grant.add_argument("--by", required=True, help="who approves (name or email)")
    grant.add_argument(
        "--ttl",
        type=duration,
        help="how long the grant stays valid: 30s, 15m, 2h, 1d "
        f"(default {_minutes(DEFAULT_APPROVAL_TTL)}, at most {MAX_APPROVAL_TTL.days}d)",
    )
    grant.add_argument("--intent", metavar="FINGERPRINT", help=intent_help)
    _json_flag(grant, "one JSON document instead of text")
    deny = _leaf(
        approvals,
        "deny",
        cmd_approvals_deny,
        "refuse one operation: the consumer will not execute it",
        "Record a denial. The consumer refuses to execute the operation while the denial "
        "is its latest decision; a later grant supersedes it, and with no grant the "
        "operation ends rejected (approval_denied) after OUTBOX_APPROVAL_DENIAL_GRACE.",
    )
    deny.add_argument("operation_id", metavar="OP_ID", help=OP_ID_HELP)
    deny.add_argument("--by", required=True, help="who denies (name or email)")
    # Accepted so that a lifetime given to a denial meets the rule the console's post
    # meets (outbox.operator.input.approval_ttl), not an argparse error of its own.
    deny.add_argument(
        "--ttl", type=duration, help="refused: a denial stands until a later grant supersedes it"
    )
    deny.add_argument("--intent", metavar="FINGERPRINT", help=intent_help)
    _json_flag(deny, "one JSON document instead of text")


def configure_stats(commands: Commands) -> None:
    """Register ``outbox stats``."""
    stats = _leaf(
        commands,
        "stats",
        cmd_stats,
        "operations by state and tool, outbox backlog, what waits for a person",
        "Counts of operations by tool and state, unpublished outbox rows and the age of "
        "the oldest, escalations and approvals waiting for a person.",
    )
    _json_flag(stats, "one JSON document instead of text")


def configure_providers(commands: Commands) -> None:
    """Register ``outbox providers``."""
    providers = _leaf(
        commands,
        "providers",
        cmd_providers,
        "each provider's breaker: down or not, since when, what waits for it",
        "One line per provider whose calls ever failed (a row of provider_health): its "
        "breaker's state (closed; open: nobody calls it, its operations wait and spend "
        "no attempt and no lookup; half_open: one probe is out), since when it is down, "
        "the probes sent, the next one, the provider's Retry-After (NOT BEFORE), the "
        "last failure, and with --tools (or OUTBOX_TOOLS) how many operations wait for "
        "it; without the tools modules, the waiting operations by tool. --events "
        "PROVIDER lists that provider's outages instead, newest first. Reads only; "
        "needs a login that is a member of outbox_operator.",
    )
    providers.add_argument(
        "--events",
        metavar="PROVIDER",
        help="that provider's breaker, then its outage events (provider.unavailable, "
        "provider.available), newest first; exit 1 if it has neither",
    )
    providers.add_argument(
        "--limit",
        type=positive_int_up_to(MAX_EVENTS_LIMIT),
        help=f"with --events: show at most N events (default {DEFAULT_EVENTS_LIMIT})",
    )
    add_tools_flag(providers, used_for="to count each provider's waiting operations")
    _json_flag(
        providers,
        "one JSON document instead of text: {providers: [...], tools_loaded, "
        "waiting_by_tool, unattributed_waiting}; with --events {provider, health, events}",
    )
