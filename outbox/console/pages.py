"""The console's pages: overview, operations, one operation, escalations, approvals and
dead letters. Reads only; every write is in :mod:`outbox.console.actions`.

Database work runs in a worker thread on a connection of its own, one transaction per
request, as ``outbox ops`` runs one per command.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import UUID

import psycopg
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import Response

from outbox import store
from outbox.bounds import is_unreadable
from outbox.connections import command_transaction
from outbox.console.app import HTTPProblem, console_of, page, render
from outbox.console.forms import (
    APPROVAL_TTLS,
    DEFAULT_TTL_CHOICE,
    discard_selection,
    resolution_choices,
)
from outbox.contract_card import provider_check
from outbox.contracts import Registry, ToolContract
from outbox.errors import OperationNotFound, OutboxError
from outbox.fingerprint_key import keyed_fingerprint
from outbox.models import Approval, ApprovalCheck, Callback, Operation
from outbox.operator import dlq, dlq_discard, history_commands, queues, timeline, views, waits
from outbox.operator.archived import approval_when_settled
from outbox.operator.input import has_controls
from outbox.operator.queues import QueueState
from outbox.operator.render import age_text, stamp, stats_json, unreadable_text
from outbox.operator.render_providers import outage_text, waiting_by_tool_text
from outbox.operator.views import Escalation, ProvidersView
from outbox.settings import Settings
from outbox.states import OperationState
from outbox.store import (
    ArchivedOperation,
    ChainReport,
    Cursor,
    EventsPage,
    OperationFilter,
    OperationPage,
    PreparedWait,
    PreparedWaits,
    Store,
)
from outbox.store.dispatch import EXACT_SETTLED_COUNT_BELOW
from outbox.text import printable

S = OperationState
T = TypeVar("T")
PAGE_SIZE = 50
# Events on one operation page: the newest by default, a link to each neighbour page.
EVENTS_PAGE = timeline.DEFAULT_EVENTS
# Longer than any tool name or run id the runtime accepts; a filter is never a payload.
MAX_FILTER_TEXT = 200
# How long the overview waits for the broker's dead-letter count before showing none.
BROKER_SECONDS = 5.0


def _db(settings: Settings, work: Callable[[Store], T]) -> T:
    with command_transaction(settings) as connection:
        # A page only reads: a read-only transaction makes that Postgres's rule too, so
        # no GET (which a link, a prefetch or a refresh can send) can ever write.
        connection.read_only = True
        return work(Store(connection))


async def read(request: Request, work: Callable[[Store], T]) -> T:
    """Run ``work(store)`` in one transaction on a worker thread."""
    return await run_in_threadpool(_db, console_of(request).settings, work)


async def _dead_letter_count(settings: Settings) -> tuple[int | None, str | None]:
    try:
        listing = await asyncio.wait_for(
            dlq.list_dead_letters(settings, limit=0), timeout=BROKER_SECONDS
        )
    except TimeoutError:
        return None, "the broker did not answer in time"
    except OutboxError as error:
        return None, str(error)
    return listing.count, None


async def _operations_queue(settings: Settings) -> tuple[QueueState | None, str | None]:
    # Never an error page: the rest of the overview stands without the broker.
    try:
        return await queues.operations_queue(settings, seconds=BROKER_SECONDS), None
    except OutboxError as error:
        return None, str(error)


@page
async def overview(request: Request) -> Response:
    registry = console_of(request).registry

    def work(
        runner: Store,
    ) -> tuple[dict[str, Any], OperationPage, ProvidersView, PreparedWaits]:
        # The threshold read here, with the note that shows it, so both say one thing.
        stats = runner.run(store.operation_stats(exact_below=EXACT_SETTLED_COUNT_BELOW))
        escalated = runner.run(
            store.operations_page(OperationFilter(states=(S.ESCALATED,)), limit=10)
        )
        # Which providers are down, and what waits for them (as `outbox providers`).
        providers = views.provider_views(runner, registry)
        # What the prepared operations wait for: a person, or a consumer that is not there.
        return stats_json(stats), escalated, providers, runner.run(store.prepared_waits())

    numbers, escalated, providers, waits = await read(request, work)
    settings = console_of(request).settings
    (dead, dead_error), (queue, queue_error) = await asyncio.gather(
        _dead_letter_count(settings), _operations_queue(settings)
    )
    return render(
        request,
        "overview.html",
        refresh=True,
        waits=waits,
        wait_kinds=PreparedWait,
        queue=queue,
        queue_error=queue_error,
        age_text=age_text,
        numbers=numbers,
        exact_below=f"{EXACT_SETTLED_COUNT_BELOW:,}",
        states=[str(s) for s in S],
        escalated=escalated.rows,
        dead_letters=dead,
        dead_letters_error=dead_error,
        providers=providers,
        outage_text=outage_text,
        waiting_by_tool_text=waiting_by_tool_text,
        stamp=stamp,
    )


@dataclass(frozen=True)
class Listing:
    where: OperationFilter
    after: Cursor | None


def _instant(name: str, text: str) -> datetime:
    try:
        instant = datetime.fromisoformat(text.strip())
    except ValueError:
        raise HTTPProblem(
            400, f"{name}: not a time like 2026-01-31T09:30 or 2026-01-31T09:30:00+01:00"
        ) from None
    return instant if instant.tzinfo else instant.replace(tzinfo=UTC)


def parse_listing(query: QueryParams) -> Listing:
    """The filters and cursor of an operations URL; a bad value is a 400, never ignored."""
    states = []
    for value in query.getlist("state"):
        if not value:
            continue
        try:
            states.append(OperationState(value))
        except ValueError:
            raise HTTPProblem(
                400, f"state: {value!r} is not one of {', '.join(str(s) for s in S)}"
            ) from None
    text = {name: (query.get(name) or "").strip() for name in ("tool", "run_id", "since", "until")}
    for name in ("tool", "run_id"):
        if len(text[name]) > MAX_FILTER_TEXT or has_controls(text[name]):
            raise HTTPProblem(
                400, f"{name}: at most {MAX_FILTER_TEXT} characters, and no control characters"
            )
    since = _instant("since", text["since"]) if text["since"] else None
    until = _instant("until", text["until"]) if text["until"] else None
    after = None
    after_ts, after_id = query.get("after_ts"), query.get("after_id")
    if after_ts or after_id:
        if not (after_ts and after_id):
            raise HTTPProblem(400, "a page cursor needs both after_ts and after_id")
        try:
            after = Cursor(updated_at=_instant("after_ts", after_ts), id=UUID(after_id))
        except ValueError:
            raise HTTPProblem(400, "after_id: not an operation id") from None
    where = OperationFilter(
        states=tuple(states),
        tool=text["tool"] or None,
        run_id=text["run_id"] or None,
        since=since,
        until=until,
    )
    return Listing(where=where, after=after)


def next_page_query(query: QueryParams, cursor: Cursor) -> str:
    kept = [(k, v) for k, v in query.multi_items() if k not in ("after_ts", "after_id")]
    kept += [("after_ts", cursor.updated_at.isoformat()), ("after_id", str(cursor.id))]
    return str(QueryParams(kept))


async def _operation_list(
    request: Request, template: str, listing: Listing, **context: Any
) -> Response:
    def work(runner: Store) -> tuple[OperationPage, dict[UUID, Escalation]]:
        result = runner.run(
            store.operations_page(listing.where, after=listing.after, limit=PAGE_SIZE)
        )
        # Why each escalated row waits for a person, and since when (as `ops list`).
        return result, views.escalations(runner, ((row.id, row.state) for row in result.rows))

    result, escalations = await read(request, work)
    return render(
        request,
        template,
        rows=result.rows,
        escalations=escalations,
        now=datetime.now(UTC),
        age_text=age_text,
        next_query=next_page_query(request.query_params, result.next) if result.next else None,
        first_page=listing.after is None,
        where=listing.where,
        query=request.query_params,
        states=[str(s) for s in S],
        stamp=stamp,
        **context,
    )


@page
async def operations(request: Request) -> Response:
    return await _operation_list(request, "operations.html", parse_listing(request.query_params))


@page
async def escalations(request: Request) -> Response:
    listing = parse_listing(request.query_params)
    only_escalated = Listing(
        where=OperationFilter(
            states=(S.ESCALATED,),
            tool=listing.where.tool,
            run_id=listing.where.run_id,
            since=listing.where.since,
            until=listing.where.until,
        ),
        after=listing.after,
    )
    return await _operation_list(request, "escalations.html", only_escalated)


@dataclass(frozen=True)
class TimelineQuery:
    """Which page of an operation's timeline a URL asks for: after an event, before one,
    or (neither) the newest."""

    after: int | None = None
    before: int | None = None


def parse_timeline(query: QueryParams) -> TimelineQuery:
    """The timeline cursor of an operation URL; a bad value is a 400, never ignored."""
    given = {name: query.get(name) for name in ("after", "before")}
    if given["after"] is not None and given["before"] is not None:
        raise HTTPProblem(400, "a timeline page starts after one event or ends before one")
    cursors: dict[str, int | None] = {}
    for name, text in given.items():
        try:
            cursors[name] = None if text is None else timeline.event_cursor(text)
        except ValueError as error:
            raise HTTPProblem(400, f"{name}: {error}") from None
    return TimelineQuery(after=cursors["after"], before=cursors["before"])


@dataclass(frozen=True)
class OperationView:
    operation: Operation
    page: EventsPage
    approval: ApprovalCheck | None
    approvals: list[Approval]
    fingerprint_key: str
    callbacks: list[Callback]
    unpublished: bool
    """An outbox row of it waits for the dispatcher."""
    escalation: Escalation | None
    """Why and since when a person has it, when it is escalated."""
    archived: ArchivedOperation | None = None
    """When and how it left the hot tables, for an operation only history holds."""

    def short(self, fingerprint: str) -> str:
        """The keyed short fingerprint, the one form a person reads anywhere."""
        return keyed_fingerprint(self.fingerprint_key, fingerprint)


def contract_of(registry: Registry | None, operation: Operation) -> ToolContract[Any] | None:
    if registry is None:
        return None
    try:
        return registry.get(operation.tool_name, operation.tool_version)
    except OutboxError:
        return None


def contract_card(registry: Registry | None, operation: Operation) -> str:
    contract = contract_of(registry, operation)
    if contract is not None:
        return contract.card()
    if registry is None:
        return (
            "no tools modules are loaded in this console: start it with --tools MODULE "
            "(or OUTBOX_TOOLS) to see the contract card"
        )
    return (
        f"{operation.tool_name} v{operation.tool_version} is not registered in the tools "
        "modules this console loaded"
    )


def provider_check_text(registry: Registry | None, operation: Operation) -> str:
    """What to check at the provider, from the contract card's fields."""
    contract = contract_of(registry, operation)
    if contract is None:
        return (
            f"Ask the provider of {operation.tool_name} for the effect it made with this "
            "operation's id as its idempotency key. The contract card says more: "
            + contract_card(registry, operation)
        )
    return provider_check(contract)


def intent_json(tool_input: dict[str, Any]) -> str:
    """The input as indented JSON. Its line breaks are JSON's own (a newline inside a
    string is escaped by JSON), so each line can go through ``printable`` on its own."""
    if is_unreadable(tool_input):
        return f"(unreadable: {unreadable_text(tool_input)}; it is never executed)"
    text = json.dumps(tool_input, indent=2, ensure_ascii=False, sort_keys=True)
    return "\n".join(printable(line) for line in text.splitlines())


def attributes_text(attributes: dict[str, Any]) -> list[tuple[str, str]]:
    if is_unreadable(attributes):
        return [("attributes", f"unreadable: {unreadable_text(attributes)}")]
    keys: list[str] = [k for k in ("from", "to") if k in attributes]
    keys += sorted(k for k in attributes if k not in ("from", "to"))
    return [
        (key, value if isinstance(value, str) else json.dumps(value, sort_keys=True))
        for key in keys
        for value in [attributes[key]]
    ]


def load_operation(
    runner: Store, operation_id: UUID, where: TimelineQuery = TimelineQuery()
) -> OperationView:
    operation = runner.run(store.get_operation(operation_id))
    return OperationView(
        operation=operation,
        page=runner.run(
            store.events_page(
                operation_id, after_id=where.after, before_id=where.before, limit=EVENTS_PAGE
            )
        ),
        approval=(
            runner.run(store.check_approval(operation_id)) if operation.requires_approval else None
        ),
        approvals=runner.run(store.operation_approvals(operation_id)),
        fingerprint_key=runner.run(store.fingerprint_key()),
        callbacks=runner.run(store.callbacks_of([operation_id])).get(operation_id, []),
        unpublished=any(
            row.published_at is None for row in runner.run(store.outbox_rows(operation_id))
        ),
        escalation=views.escalations(runner, [(operation_id, operation.state)]).get(operation_id),
    )


def load_archived(
    runner: Store, operation_id: UUID, where: TimelineQuery = TimelineQuery()
) -> OperationView:
    """An operation only history holds, as :func:`load_operation` reads a hot one (the
    approval check as it stood when it settled); OperationNotFound when history does
    not hold it either."""
    archived = runner.run(store.archived_facts(operation_id))
    if archived is None:
        raise OperationNotFound(f"no operation with id {operation_id}")
    key = runner.run(store.fingerprint_key())
    page = store.archived_events_page(
        operation_id, after_id=where.after, before_id=where.before, limit=EVENTS_PAGE
    )
    return OperationView(
        operation=archived.operation,
        page=runner.run(page),
        approval=approval_when_settled(archived, key),
        approvals=archived.approvals[::-1],  # newest first, as a hot operation's
        fingerprint_key=key,
        callbacks=archived.callbacks,
        unpublished=False,
        escalation=None,
        archived=archived,
    )


def load_any(runner: Store, operation_id: UUID, where: TimelineQuery) -> OperationView:
    """The hot tables first; history only for what they no longer hold."""
    try:
        return load_operation(runner, operation_id, where)
    except OperationNotFound:
        return load_archived(runner, operation_id, where)


def approval_pending(view: OperationView) -> bool:
    check = view.approval
    return view.operation.state is S.PREPARED and check is not None and not check.is_valid


async def _evidence_chain(
    request: Request, operation_id: UUID, archived: bool
) -> tuple[ChainReport | None, str | None]:
    """The operation's evidence chain, checked in a transaction of its own (an archived
    one's recomputed from its history row): a check that cannot run (a database without
    the chain, a login without the grant) leaves the rest of the page as it is and says
    why."""

    def check(runner: Store) -> ChainReport | None:
        if archived:
            return history_commands.archived_chain(runner, operation_id)
        report: ChainReport = runner.run(store.verify_chain(operation_id))
        return report

    try:
        report = await read(request, check)
    except (OutboxError, psycopg.Error) as error:
        return None, f"could not be checked ({type(error).__name__})"
    if report is None:
        return None, "could not be checked: history no longer holds it"
    return report, None


@page
async def operation(request: Request) -> Response:
    named = request.path_params["operation_id"]
    # Any name `outbox ops show` accepts, a short id included (views.operation_id_of).
    operation_id = await read(request, lambda r: views.operation_id_of(r, named))
    where = parse_timeline(request.query_params)
    try:
        view: OperationView = await read(request, lambda r: load_any(r, operation_id, where))
    except OperationNotFound:
        raise HTTPProblem(404, "no operation with this id") from None
    chain, chain_error = await _evidence_chain(request, operation_id, view.archived is not None)
    console = console_of(request)
    op = view.operation
    now = datetime.now(UTC)
    return render(
        request,
        "operation.html",
        view=view,
        op=op,
        wait=waits.operation_wait(
            op,
            approval=view.approval,
            unpublished=view.unpublished,
            contract=contract_of(console.registry, op),
            now=now,
        ),
        now=now,
        age_text=age_text,
        provider_check=provider_check_text(console.registry, op),
        intent=intent_json(view.operation.input),
        card=contract_card(console.registry, view.operation),
        attributes_text=attributes_text,
        resolutions=resolution_choices(console.registry, view.operation),
        approval_pending=approval_pending(view),
        ttls=APPROVAL_TTLS,
        default_ttl=DEFAULT_TTL_CHOICE,
        chain=chain,
        chain_error=chain_error,
        timeline_heading=timeline.heading(view.page),
        stamp=stamp,
    )


@dataclass(frozen=True)
class PendingView:
    operation: Operation
    check: ApprovalCheck
    short_fingerprint: str
    decided_by: str | None


@page
async def approvals(request: Request) -> Response:
    def work(runner: Store) -> list[PendingView]:
        pending = runner.run(store.pending_approvals())
        key = runner.run(store.fingerprint_key())
        # The approver judges the intent itself: read per operation, in this transaction.
        return [
            PendingView(
                operation=runner.run(store.get_operation(p.operation.id)),
                check=p.check,
                short_fingerprint=keyed_fingerprint(key, p.operation.input_fingerprint),
                decided_by=p.decided_by,
            )
            for p in pending
        ]

    pending: list[PendingView] = await read(request, work)
    return render(
        request,
        "approvals.html",
        pending=pending,
        intent_json=intent_json,
        ttls=APPROVAL_TTLS,
        default_ttl=DEFAULT_TTL_CHOICE,
        stamp=stamp,
    )


async def _from_broker(work: Awaitable[T]) -> T:
    try:
        return await asyncio.wait_for(work, timeout=BROKER_SECONDS * 2)
    except TimeoutError:
        raise HTTPProblem(503, "the broker did not answer in time") from None
    except OutboxError as error:
        raise HTTPProblem(503, f"the dead-letter queue cannot be read: {error}") from None


async def _with_operations(
    request: Request, letters: list[dlq.DeadLetter]
) -> tuple[list[views.DeadLetterView], str | None]:
    try:
        return await read(request, lambda r: views.dead_letter_views(r, letters)), None
    except (OutboxError, psycopg.Error) as error:
        # The broker's view stands on its own: say why the operations are not beside it.
        return [views.dead_letter_views_without_database(m) for m in letters], (
            f"the operations could not be read ({type(error).__name__})"
        )


@page
async def dead_letters(request: Request) -> Response:
    settings = console_of(request).settings
    listing = await _from_broker(dlq.list_dead_letters(settings, limit=dlq.DEFAULT_LIST_LIMIT))
    messages, database_error = await _with_operations(request, list(listing.messages))
    return render(
        request,
        "dead_letters.html",
        listing=listing,
        messages=messages,
        database_error=database_error,
        now=datetime.now(UTC),
        age_text=age_text,
        stamp=stamp,
    )


@page
async def discard_preview(request: Request) -> Response:
    """What a discard would take, and what becomes of each message's operation; the
    discard itself is the form this page carries (:func:`outbox.console.actions.discard`)."""
    query = request.query_params
    selection = discard_selection(query.get("message_id"), query.get("malformed"))
    report = await _from_broker(
        dlq_discard.discard_dead_letters(
            console_of(request).settings,
            selection,
            record=None,
            reason="",
            by="",
            limit=dlq.DEFAULT_LIST_LIMIT,
        )
    )
    letters = [candidate.letter for candidate in report.selected]
    messages, database_error = await _with_operations(request, letters)
    return render(
        request,
        "discard_dead_letters.html",
        report=report,
        rows=list(zip(report.selected, messages, strict=True)),
        fate=dlq_discard.discard_fate,
        message_id=query.get("message_id") or "",
        malformed=query.get("malformed") == "yes",
        limit=dlq.DEFAULT_LIST_LIMIT,
        database_error=database_error,
        stamp=stamp,
    )
