"""The console's state-changing requests: resolve an escalation, grant or deny an
approval, requeue or discard dead letters.

Each is :func:`~outbox.console.app.action`-wrapped (session CSRF token checked first),
takes the operator's name from the session, and calls the same operator functions as
``outbox ops resolve``, ``outbox approvals grant|deny`` and ``outbox dlq requeue|discard``
(:mod:`outbox.operator`), in one transaction: a refusal at any point changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar
from uuid import UUID

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.connections import command_transaction
from outbox.console import forms
from outbox.console.app import HTTPProblem, action, console_of, session_of
from outbox.logs import log_fields
from outbox.operator import dlq, dlq_discard, views
from outbox.operator import rules as operator_rules
from outbox.operator.input import discard_reason
from outbox.operator.render import approval_decided_text, resolved_text
from outbox.store import Store

log = logging.getLogger("outbox.console")
T = TypeVar("T")


def confirmation(answer: str) -> str:
    """The first line of what `outbox ops`/`outbox approvals` answer: the same words."""
    return answer.splitlines()[0]


async def _on_named(request: Request, work: Callable[[Store, UUID], T]) -> T:
    """``work`` on the operation the URL names (any name ``outbox ops`` takes), in one
    transaction on a worker thread: a refusal anywhere changes nothing."""
    settings = console_of(request).settings
    named = request.path_params["operation_id"]

    def run() -> T:
        with command_transaction(settings) as connection:
            runner = Store(connection)
            return work(runner, views.operation_id_of(runner, named))

    return await run_in_threadpool(run)


async def _resolve_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    resolution = forms.resolution(form.get("resolution"))
    # What the person typed goes to the operator layer as it came, to be judged there.
    reason = forms.text(form.get("reason"))
    reference = forms.text(form.get("provider_reference"))
    resolved = await _on_named(
        request,
        lambda runner, operation_id: operator_rules.resolve(
            runner,
            operation_id,
            resolution,
            by=operator,
            evidence=reason,
            provider_reference=reference,
            force=form.get("force") == "yes",
            registry=console.registry,
        ),
    )
    session_of(request).notice = confirmation(resolved_text(resolved, operator))
    return RedirectResponse(f"/operations/{resolved.after.display_id}", status_code=303)


resolve = action(_resolve_action)


async def _decide_action(request: Request, form: FormData, operator: str) -> Response:
    decision = forms.decision(form.get("decision"))
    shown = forms.fingerprint(form.get("fingerprint"))
    # A lifetime, if the form carries one, is the operator layer's to accept or refuse.
    ttl = forms.approval_ttl(form.get("ttl"))
    # Bound to the intent this page showed: refused if the operation's intent is another
    # one now (operator.rules.decide_approval).
    decided = await _on_named(
        request,
        lambda runner, operation_id: operator_rules.decide_approval(
            runner, operation_id, decision, by=operator, ttl=ttl, shown=shown
        ),
    )
    session_of(request).notice = confirmation(approval_decided_text(decided))
    return RedirectResponse(f"/operations/{decided.operation.display_id}", status_code=303)


decide = action(_decide_action)


async def _requeue_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    selection = form.get("message_id")
    every = form.get("all") == "yes"
    if every == bool(selection) or (selection is not None and not isinstance(selection, str)):
        raise forms.FormRefused("choose one message, or all of them")
    ids = None if every else [str(selection)]
    report = await dlq.requeue_dead_letters(console.settings, message_ids=ids)
    # The broker keeps no record of who requeued: this line is that record. It names
    # the operator because nothing else can; it never carries a message body.
    log_fields(
        log,
        logging.WARNING,
        "console.dlq_requeue",
        "dead letters requeued from the console",
        operator=operator,
        requeued=report.requeued,
        selection="all" if every else "one",
    )
    if not every and report.requeued == 0:
        raise HTTPProblem(
            404, "no message with that id is in the dead-letter queue (requeued by someone else?)"
        )
    session_of(
        request
    ).notice = f"requeued {report.requeued} dead letter(s) to the operations exchange"
    return RedirectResponse("/dead-letters", status_code=303)


requeue = action(_requeue_action)


async def _discard_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    # Only what the preview showed: a message dead-lettered since is not taken unseen.
    selection = forms.discard_selection(form.get("message_id"), form.get("malformed")).shown_in(
        forms.previewed_bodies(form.get("bodies"))
    )
    reason = discard_reason(forms.text(form.get("reason")))
    report = await dlq_discard.discard_dead_letters(
        console.settings,
        selection,
        record=dlq_discard.recorder(console.settings),
        reason=reason,
        by=operator,
    )
    # The record in Postgres says who and why; this line says a discard happened, with
    # ids only (never a body, never the reason a person typed).
    log_fields(
        log,
        logging.WARNING,
        "console.dlq_discard",
        "dead letters discarded from the console",
        operator=operator,
        discarded=len(report.records),
        records=",".join(str(record.id) for record in report.records) or "-",
        selection="malformed" if selection.malformed else "one",
    )
    if not report.records:
        raise HTTPProblem(
            404,
            "no such message is in the dead-letter queue (discarded or requeued by someone else?)",
        )
    session_of(request).notice = (
        f"discarded {len(report.records)} dead letter(s), each recorded first "
        "(outbox dlq discarded lists the record)"
    )
    return RedirectResponse("/dead-letters", status_code=303)


discard = action(_discard_action)
