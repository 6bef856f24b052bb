"""How operator output reads: tables and stamps for a terminal, the same records as
JSON, for ``outbox ops``, ``outbox approvals``, ``outbox stats``, ``outbox providers``
and the console.

Run ids, names, reasons, error text and inputs were chosen by agents, providers or other
people: in human-readable output every one goes through :func:`printable`, so none can
move the cursor, rewrite a line or recolour the terminal. JSON output is escaped by
JSON. An operation's input (its intent) is rendered only where a person must judge it
(``ops show``, ``approvals pending``): listings and stats never carry it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from outbox.bounds import is_unreadable, unreadable_reason
from outbox.fingerprint_key import keyed_fingerprint
from outbox.models import (
    ApprovalCheck,
    ApprovalDecision,
    ApprovalStatus,
    Callback,
    display_operation_id,
)
from outbox.operator.dlq import Listing
from outbox.operator.rules import ApprovalDecided, Resolved
from outbox.operator.views import DeadLetterView, Escalation
from outbox.states import OperationState
from outbox.store import (
    ChainReport,
    OperationStats,
    OperationSummary,
    PendingApproval,
)
from outbox.store.evidence import REASONS
from outbox.text import logfmt_key, logfmt_value, printable

S = OperationState


def stamp(moment: datetime | None) -> str:
    """A time as a person reads it, one form in every command and on every console page:
    UTC to the second, ``2026-12-02T03:04:05Z``, 20 characters that never wrap. The
    fraction is cut, not rounded, so a stamp is never later than its moment; where
    order matters the rows are already in order (a timeline, a listing)."""
    if moment is None:
        return "-"
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def instant(moment: datetime | None) -> str | None:
    """A time in ``--json`` output: ISO 8601 in UTC at the database's full precision
    (microseconds), ``2026-12-02T03:04:05.123456Z``, for scripts that compare or order."""
    if moment is None:
        return None
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def age_text(seconds: float) -> str:
    """A waiting time a person reads at a glance: ``45s``, ``12m``, ``3h 5m``, ``2d 4h``."""
    whole = max(0, int(seconds))
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m" if minutes else f"{secs}s"


def escalation_json(escalation: Escalation | None, now: datetime) -> dict[str, Any] | None:
    if escalation is None:
        return None
    return {
        "reason": escalation.reason,
        "since": instant(escalation.since),
        "waiting_seconds": round((now - escalation.since).total_seconds(), 3),
    }


def summary_json(
    summary: OperationSummary, key: str, escalation: dict[str, Any] | None = None
) -> dict[str, Any]:
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
        "created_at": instant(summary.created_at),
        "updated_at": instant(summary.updated_at),
        "escalation": escalation,
    }


def listing_text(
    summaries: Sequence[OperationSummary],
    escalations: dict[UUID, Escalation] | None = None,
    now: datetime | None = None,
    archived_at: dict[UUID, datetime] | None = None,
) -> str:
    """The operations table; with ``escalations`` (a list of escalated operations), why
    each was handed to a person and how long it has waited; with ``archived_at`` (a
    list that covers history too), when each archived one moved there."""
    if not summaries:
        return "no operations match"
    headers = ["ID", "TOOL", "STATE", "ATTEMPTS", "RECONCILES", "LAST ERROR", "UPDATED"]
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
    if escalations is not None:
        moment = now or datetime.now(UTC)
        headers += ["ESCALATED BECAUSE", "WAITING"]
        for row, summary in zip(rows, summaries, strict=True):
            escalation = escalations.get(summary.id)
            row += (
                [escalation.reason, age_text((moment - escalation.since).total_seconds())]
                if escalation
                else ["-", "-"]
            )
    if archived_at is not None:
        headers.append("ARCHIVED")
        for row, summary in zip(rows, summaries, strict=True):
            row.append(stamp(archived_at[summary.id]) if summary.id in archived_at else "-")
    return table(headers, rows)


def event_attributes_text(name: str, attributes: dict[str, Any]) -> str:
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


def callback_json(callback: Callback) -> dict[str, Any]:
    """One callback in every ``--json``: ``callbacks list`` and ``ops show``'s
    ``callbacks`` (docs/operating.md#provider-callbacks-as-json). ``operation_id`` is the
    operation it was matched to; ``named_operation_id`` the one it named, which this
    database may not have."""

    def shown(operation_id: UUID | None) -> str | None:
        return display_operation_id(operation_id) if operation_id is not None else None

    return {
        "id": callback.id,
        "provider": callback.provider,
        "event_id": callback.event_id,
        "status": str(callback.status),
        "operation_id": shown(callback.operation_id),
        "named_operation_id": shown(callback.named_operation_id),
        "provider_reference": callback.provider_reference,
        "payload_digest": callback.payload_digest,
        "received_at": instant(callback.received_at),
        "outcome": str(callback.outcome) if callback.outcome else None,
        "applied_at": instant(callback.applied_at),
    }


def _callback_operation(callback: Callback) -> str:
    if callback.operation_id is not None:
        return display_operation_id(callback.operation_id)
    if callback.named_operation_id is not None:
        return f"{display_operation_id(callback.named_operation_id)} (unknown)"
    return "-"


_CALLBACK_COLUMNS = (
    "ID",
    "PROVIDER",
    "EVENT",
    "STATUS",
    "OPERATION",
    "REFERENCE",
    "OUTCOME",
    "RECEIVED",
)


def _callback_row(callback: Callback) -> list[str]:
    return [
        str(callback.id),
        callback.provider,
        callback.event_id,
        str(callback.status),
        _callback_operation(callback),
        callback.provider_reference or "-",
        str(callback.outcome) if callback.outcome else "not applied yet",
        stamp(callback.received_at),
    ]


def callbacks_table(callbacks: Sequence[Callback], *, operation: bool) -> str:
    """One row per callback, in every table of them: what it reported, and what the
    reconciler did with it. ``operation``: the column of the operation it named, which
    ``ops show`` leaves out as its page is that operation's. Every field a provider
    chose is escaped (:func:`table`)."""
    kept = [i for i, name in enumerate(_CALLBACK_COLUMNS) if operation or name != "OPERATION"]
    rows = [[row[i] for i in kept] for row in map(_callback_row, callbacks)]
    return table([_CALLBACK_COLUMNS[i] for i in kept], rows)


def callbacks_text(callbacks: Sequence[Callback]) -> str:
    """An operation's callbacks, in the order they came, under ``ops show``."""
    head = f"callbacks ({len(callbacks)})"
    if not callbacks:
        return head
    lines = callbacks_table(callbacks, operation=False).splitlines()
    return "\n".join([head, *("  " + line for line in lines)])


def callbacks_listing_text(callbacks: Sequence[Callback]) -> str:
    """``outbox callbacks list``: the inbox, with the operation each callback named."""
    if not callbacks:
        return "no callbacks match"
    return callbacks_table(callbacks, operation=True)


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
        # The states whose figures above are estimates, not counts ("about N").
        "estimated": [str(s) for s in S if s in stats.estimated],
    }


def stats_text(numbers: dict[str, Any]) -> str:
    states = [str(s) for s in S]
    estimated = set(numbers["estimated"])

    def cells(counts: dict[str, int]) -> list[str]:
        shown = [f"~{counts[s]}" if s in estimated else str(counts[s]) for s in states]
        return [*shown, f"{'~' if estimated else ''}{sum(counts.values())}"]

    rows = [[tool, *cells(counts)] for tool, counts in numbers["by_tool"].items()]
    rows.append(["all", *cells(numbers["by_state"])])
    lines = [table(["TOOL", *(s.upper() for s in states), "TOTAL"], rows)]
    if estimated:
        lines.append(
            f"~ about: {' and '.join(s for s in states if s in estimated)} are estimated from "
            "a sample of the operations table; the open states are counted (docs/console.md)"
        )
    lines += [
        "",
        f"outbox backlog       {numbers['outbox_backlog']} unpublished row(s), oldest waiting "
        f"{numbers['oldest_pending_age_seconds']:.1f} s",
        f"escalations waiting  {numbers['escalations_waiting']}  "
        "(outbox ops list --state escalated)",
        f"approvals waiting    {numbers['approvals_waiting']}  (outbox approvals pending)",
    ]
    return "\n".join(lines)


def pending_json(pending: PendingApproval, key: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    listed = summary_json(pending.operation, key)
    del listed["escalation"]  # a prepared operation waiting for an approval has none
    return {
        **listed,
        "input": tool_input,
        "approval_status": str(pending.check.status),
        "approval_reason": pending.check.reason,
    }


def pending_text(
    pending: Sequence[PendingApproval], key: str, inputs: dict[UUID, dict[str, Any]]
) -> str:
    if not pending:
        return "no operations are waiting for an approval"
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
    return table(headers, rows)


def approval_decided_json(decided: ApprovalDecided) -> dict[str, Any]:
    approval = decided.approval
    return {
        "approval_id": str(approval.id),
        "operation_id": decided.operation.display_id,
        "decision": str(approval.decision),
        "by": decided.by,
        "intent": decided.intent,
        "expires_at": instant(approval.expires_at),
        "state": str(decided.operation.state),
        "requires_approval": decided.operation.requires_approval,
    }


def approval_decided_text(decided: ApprovalDecided) -> str:
    operation, approval = decided.operation, decided.approval
    by = printable(decided.by)
    if approval.decision is ApprovalDecision.DENIED:
        return "\n".join(
            [
                f"approval {approval.id}: denied by {by} for {operation.display_id} "
                f"(intent {decided.intent})",
                f"the operation stays {operation.state} for now: the consumer refuses to "
                "execute it while this denial is its latest approval decision, a later grant "
                "supersedes it, and with no grant the consumer ends it rejected "
                "(approval_denied) after OUTBOX_APPROVAL_DENIAL_GRACE",
            ]
        )
    lines = [
        f"approval {approval.id} granted by {by} for {operation.display_id} "
        f"(intent {decided.intent}), expires {stamp(approval.expires_at)}"
    ]
    if operation.state is S.PREPARED:
        lines.append("the operation is queued again and will be attempted under this grant")
    if not operation.requires_approval:
        lines.append("note: this operation did not require an approval")
    return "\n".join(lines)


_OUTCOMES = {
    S.PREPARED: "prepared: one more attempt is queued now, under the same idempotency key",
    S.REJECTED: "rejected: it will not be attempted again",
}


def resolved_text(resolved: Resolved, by: str) -> str:
    after = resolved.after
    outcome = _OUTCOMES.get(after.state) or (
        f"committed, provider reference {after.provider_reference}"
    )
    return "\n".join(
        [
            f"{after.display_id}: {resolved.before.state} -> {printable(outcome)}",
            f"resolved by {printable(by)}; the evidence is kept in its operation.resolved event",
        ]
    )


def dead_letter_fate(view: DeadLetterView, now: datetime) -> str | None:
    """What became of a dead letter's operation, where that changes what to do with it:
    escalated (resolve it; a requeue only gets acknowledged) or already settled."""
    if view.escalation is not None:
        waited = age_text((now - view.escalation.since).total_seconds())
        return (
            f"its operation is escalated ({printable(view.escalation.reason)}, {waited} ago): "
            "resolve it with `outbox ops resolve`; a requeued copy would only be acknowledged"
        )
    state = view.operation_state
    if state is not None and state is not S.PREPARED:
        return f"its operation is {state}: a requeued copy would only be acknowledged"
    return None


def dead_letters_text(listing: Listing, views: Sequence[DeadLetterView], now: datetime) -> str:
    """``outbox dlq list``: each message as the broker holds it, then why it died (the
    consumer's reason where it wrote one) and what became of its operation."""
    lines = [f"dead-lettered: {listing.count} message(s) in {listing.queue}"]
    for view in views:
        lines += [view.message.line(), f"  why: {printable(view.why)}"]
        died = view.message.died_at
        if died is not None:
            lines.append(f"  died: {stamp(died)} ({age_text((now - died).total_seconds())} ago)")
        fate = dead_letter_fate(view, now)
        if fate is not None:
            lines.append(f"  {fate}")
    if len(listing.messages) < listing.count:
        lines.append(f"(showing {len(listing.messages)}; --limit N shows more)")
    return "\n".join(lines)


def dead_letters_json(
    listing: Listing, views: Sequence[DeadLetterView], now: datetime
) -> dict[str, Any]:
    document = listing.as_json()
    document["messages"] = [
        {
            **view.message.as_json(),
            "died_at": instant(view.message.died_at),
            "why": view.why,
            "operation_state": None if view.operation_state is None else str(view.operation_state),
            "escalation": escalation_json(view.escalation, now),
        }
        for view in views
    ]
    return document
