"""The console's batch resolution: the escalations page's "resolve many" filter, a
preview of what would change, and the confirmation that resolves it.

The preview only reads (a GET in a read-only transaction). Its form carries the filter,
the database's clock at the selection and a digest of the operations it listed; the
confirming POST (CSRF-checked like every action) selects again with the window closed
at that clock, and is refused with nothing changed unless it finds exactly the listed
operations. Each is then resolved as ``outbox ops resolve`` over a filter resolves it
(:mod:`outbox.operator.batch`), by the session's operator.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response

from outbox.connections import command_transaction
from outbox.console import forms
from outbox.console.app import HTTPProblem, action, console_of, page, render
from outbox.console.pages import _instant, read
from outbox.operator import batch
from outbox.operator.render import stamp
from outbox.operator.rules import Resolution
from outbox.store import EscalationFilter, EscalationSelection, Store

FIELDS = ("tool", "reason", "run_id", "since", "until")


def filter_of(values: Mapping[str, object]) -> EscalationFilter:
    """The filter a query string or a form carries; empty fields are no condition."""
    given = {name: (forms.text(values.get(name)) or "").strip() for name in FIELDS}
    return EscalationFilter(
        tool=given["tool"] or None,
        reason=given["reason"] or None,
        run_id=given["run_id"] or None,
        since=_instant("since", given["since"]) if given["since"] else None,
        until=_instant("until", given["until"]) if given["until"] else None,
    )


def _choices() -> list[tuple[str, str]]:
    return [(str(r), r.label) for r in batch.BATCH_RESOLUTIONS]


def _hidden(where: EscalationFilter) -> dict[str, str]:
    """The filter as the confirming form sends it back."""
    values = {name: getattr(where, name) for name in FIELDS}
    return {
        name: value.isoformat() if isinstance(value, datetime) else value
        for name, value in values.items()
        if value is not None
    }


@page
async def preview(request: Request) -> Response:
    where = filter_of(request.query_params)
    selection: EscalationSelection = await read(
        request, lambda runner: batch.select(runner, where, None)
    )
    return render(
        request,
        "escalations_batch.html",
        selection=selection,
        selected=len(selection.escalations),
        left_out=selection.matched - len(selection.escalations),
        hidden=_hidden(where),
        selected_at=selection.selected_at.isoformat(),
        digest=batch.digest(selection),
        choices=_choices(),
        query=request.query_params,
        stamp=stamp,
    )


async def _resolve_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    where = filter_of(form)
    resolution = batch.batch_resolution(forms.resolution(form.get("resolution")))
    selected_at = _instant("selected_at", forms.text(form.get("selected_at")) or "")
    shown = forms.text(form.get("selection"))
    if not shown:
        raise HTTPProblem(400, "the form does not carry the selection it previewed")
    evidence = forms.text(form.get("evidence"))

    def run() -> batch.BatchReport:
        with command_transaction(console.settings) as connection:
            selection = batch.confirmed(Store(connection), where, None, selected_at, shown)
            return batch.resolve_selected(
                connection,
                selection,
                resolution,
                by=operator,
                evidence=evidence,
                registry=console.registry if resolution is Resolution.NOT_COMMITTED else None,
            )

    report = await run_in_threadpool(run)
    return render(request, "escalations_batch_done.html", report=report, hidden=_hidden(where))


resolve = action(_resolve_action)
