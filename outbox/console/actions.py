"""The console's state-changing requests: resolve an escalation, grant or deny an
approval, requeue dead letters.

Each is :func:`~outbox.console.app.action`-wrapped (session CSRF token checked first),
takes the operator's name from the session, and calls the same operator functions as
``outbox ops resolve``, ``outbox approvals grant|deny`` and ``outbox dlq requeue``
(:mod:`outbox.operator`), in one transaction: a refusal at any point changes nothing.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from uuid import UUID

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.connections import command_transaction
from outbox.console import rules
from outbox.console.app import HTTPProblem, action, console_of, session_of
from outbox.contracts import Registry
from outbox.logs import log_fields
from outbox.models import ApprovalDecision, display_operation_id
from outbox.operator import dlq
from outbox.operator import rules as operator_rules
from outbox.operator.render import approval_decided_text, resolved_text
from outbox.operator.rules import ApprovalDecided, Resolution, Resolved
from outbox.settings import Settings
from outbox.store import Store

log = logging.getLogger("outbox.console")


def confirmation(answer: str) -> str:
    """The first line of what `outbox ops`/`outbox approvals` answer: the same words."""
    return answer.splitlines()[0]


def _resolve(
    settings: Settings,
    operation_id: UUID,
    resolution: Resolution,
    *,
    reason: str,
    reference: str | None,
    force: bool,
    operator: str,
    registry: Registry | None,
) -> Resolved:
    with command_transaction(settings) as connection:
        return operator_rules.resolve(
            Store(connection),
            operation_id,
            resolution,
            by=operator,
            evidence=reason,
            provider_reference=reference,
            force=force,
            registry=registry,
        )


async def _resolve_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    operation_id = rules.operation_id_from(request.path_params["operation_id"])
    resolution = rules.resolution(form.get("resolution"))
    reason = rules.reason(form.get("reason"))
    reference = rules.provider_reference(form.get("provider_reference"), resolution.target)
    resolved = await run_in_threadpool(
        lambda: _resolve(
            console.settings,
            operation_id,
            resolution,
            reason=reason,
            reference=reference,
            force=form.get("force") == "yes",
            operator=operator,
            registry=console.registry,
        )
    )
    session_of(request).notice = confirmation(resolved_text(resolved, operator))
    return RedirectResponse(f"/operations/{display_operation_id(operation_id)}", status_code=303)


resolve = action(_resolve_action)


def _decide(
    settings: Settings,
    operation_id: UUID,
    decision: ApprovalDecision,
    *,
    shown: str,
    ttl: timedelta,
    operator: str,
) -> ApprovalDecided:
    with command_transaction(settings) as connection:
        # Bound to the intent this page showed: refused if the operation's intent is
        # another one now (operator.rules.decide_approval).
        return operator_rules.decide_approval(
            Store(connection), operation_id, decision, by=operator, ttl=ttl, shown=shown
        )


async def _decide_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    operation_id = rules.operation_id_from(request.path_params["operation_id"])
    choice = form.get("decision")
    if choice not in ("grant", "deny"):
        raise rules.FormRefused("choose grant or deny")
    shown = rules.fingerprint(form.get("fingerprint"))
    granted = choice == "grant"
    ttl = rules.approval_ttl(form.get("ttl")) if granted else operator_rules.DENIAL_TTL
    decided = await run_in_threadpool(
        lambda: _decide(
            console.settings,
            operation_id,
            ApprovalDecision.GRANTED if granted else ApprovalDecision.DENIED,
            shown=shown,
            ttl=ttl,
            operator=operator,
        )
    )
    session_of(request).notice = confirmation(approval_decided_text(decided))
    return RedirectResponse(f"/operations/{display_operation_id(operation_id)}", status_code=303)


decide = action(_decide_action)


async def _requeue_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    selection = form.get("message_id")
    every = form.get("all") == "yes"
    if every == bool(selection) or (selection is not None and not isinstance(selection, str)):
        raise rules.FormRefused("choose one message, or all of them")
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
