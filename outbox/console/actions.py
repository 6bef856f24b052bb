"""The console's state-changing requests: resolve an escalation, grant or deny an
approval, requeue dead letters.

Each is :func:`~outbox.console.app.action`-wrapped (session CSRF token checked first),
takes the operator's name from the session, and runs the same store operations and
checks as ``outbox ops resolve``, ``outbox approvals grant|deny`` and ``outbox dlq
requeue``, in one transaction: a refusal at any point changes nothing.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from uuid import UUID

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox import dlq, store
from outbox.console import rules
from outbox.console.app import HTTPProblem, action, console_of
from outbox.contracts import Registry
from outbox.errors import IllegalTransition
from outbox.fingerprint_key import keyed_fingerprint
from outbox.logs import log_fields
from outbox.models import ApprovalDecision, display_operation_id
from outbox.ops import _DENIAL_TTL, _approvable, _connect, _resolvable
from outbox.settings import Settings
from outbox.states import OperationState
from outbox.store import Store

S = OperationState
log = logging.getLogger("outbox.console")


def _resolve(
    settings: Settings,
    operation_id: UUID,
    *,
    choice: str,
    target: OperationState,
    decision: str,
    reason: str,
    reference: str | None,
    force: bool,
    operator: str,
    registry: Registry | None,
) -> None:
    with _connect(settings) as connection:
        runner = Store(connection)
        current = runner.run(store.get_operation(operation_id))
        _resolvable(current, force)
        if choice == "retry":
            refused = rules.retry_refusal(registry, current)
            if refused:
                raise IllegalTransition(f"a retry is not offered: {refused}; nothing was changed")
        # The transition is fenced on the state just read: if anything moved the
        # operation since, the statement matches no row and nothing is written.
        runner.run(
            store.resolve_operation(
                operation_id,
                source=current.state,
                target=target,
                decision=decision,
                resolved_by=operator,
                evidence=reason,
                provider_reference=reference,
            )
        )


async def _resolve_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    operation_id = rules.operation_id_from(request.path_params["operation_id"])
    choice = form.get("resolution")
    decision, target = rules.resolution(choice)
    reason = rules.reason(form.get("reason"))
    reference = rules.provider_reference(form.get("provider_reference"), target)
    await run_in_threadpool(
        lambda: _resolve(
            console.settings,
            operation_id,
            choice=str(choice),
            target=target,
            decision=decision,
            reason=reason,
            reference=reference,
            force=form.get("force") == "yes",
            operator=operator,
            registry=console.registry,
        )
    )
    return RedirectResponse(f"/operations/{display_operation_id(operation_id)}", status_code=303)


resolve = action(_resolve_action)


def _decide(
    settings: Settings,
    operation_id: UUID,
    *,
    decision: ApprovalDecision,
    shown: str,
    ttl: timedelta,
    operator: str,
) -> None:
    with _connect(settings) as connection:
        runner = Store(connection)
        current = runner.run(store.get_operation(operation_id))
        _approvable(current)
        if current.input_fingerprint != shown:
            # The page showed another intent than the operation has now: approving it
            # would approve something nobody read.
            key = runner.run(store.fingerprint_key())
            raise IllegalTransition(
                f"{current.display_id}: the intent changed since this page was shown "
                f"(shown {keyed_fingerprint(key, shown)}, now "
                f"{keyed_fingerprint(key, current.input_fingerprint)}); reload and judge "
                "the current intent. Nothing was granted or denied"
            )
        runner.run(
            store.decide_approval(
                operation_id,
                decision=decision,
                approved_by=operator,
                ttl=ttl,
                # Bound to what was shown: even if the check above raced a change, the
                # consumer refuses a grant for another intent.
                intent_hash=shown,
            )
        )


async def _decide_action(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    operation_id = rules.operation_id_from(request.path_params["operation_id"])
    choice = form.get("decision")
    if choice not in ("grant", "deny"):
        raise rules.FormRefused("choose grant or deny")
    shown = rules.fingerprint(form.get("fingerprint"))
    granted = choice == "grant"
    ttl = rules.approval_ttl(form.get("ttl")) if granted else _DENIAL_TTL
    await run_in_threadpool(
        lambda: _decide(
            console.settings,
            operation_id,
            decision=ApprovalDecision.GRANTED if granted else ApprovalDecision.DENIED,
            shown=shown,
            ttl=ttl,
            operator=operator,
        )
    )
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
    return RedirectResponse("/dead-letters", status_code=303)


requeue = action(_requeue_action)
