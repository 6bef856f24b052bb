"""The operator's commands (``outbox ops``, ``outbox approvals``, ``outbox stats``):
list operations, list those waiting for an approval, count them, and let a person
resolve one with evidence."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import astuple, dataclass, fields
from datetime import datetime, timedelta
from uuid import UUID

from psycopg.types.json import Jsonb

from outbox import lifecycle
from outbox.errors import IllegalTransition
from outbox.models import Approval, ApprovalCheck, Operation
from outbox.states import (
    FENCED_SOURCES,
    TERMINAL_STATES,
    EventName,
    OperationState,
    Waiting,
    is_legal,
    legal_targets,
)
from outbox.store.approvals import approval_check
from outbox.store.dispatch import EXACT_SETTLED_COUNT_BELOW, Backlog, outbox_backlog
from outbox.store.operations import fingerprint_key, get_operation
from outbox.store.runner import Plan, Row, Step

# How many characters of an operator's evidence a resolution keeps in its event: a
# longer one is refused, never cut (outbox.operator.input.evidence says so first).
RESOLUTION_EVIDENCE_LIMIT = 500

# How many of the operations table's pages the overview's estimate of the settled
# operations reads (8 MB at the default block size; about 18,000 operations as
# bench.history_scale fills them): its cost, whatever the history holds.
SETTLED_SAMPLE_PAGES = 1_000
# Estimates are shown to three significant figures: the sample cannot say more.
_ESTIMATE_DIGITS = 3


@dataclass(frozen=True)
class OperationSummary:
    """What an operator sees of an operation in a listing: everything but its input."""

    id: UUID
    run_id: str
    tool_name: str
    tool_version: int
    side_effect: str
    input_fingerprint: str
    requires_approval: bool
    state: OperationState
    attempts: int
    reconcile_attempts: int
    provider_reference: str | None
    last_error_class: str | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Row) -> OperationSummary:
        """From a row that holds at least these columns (a listing may read more)."""
        values = {name: row[name] for name in _SUMMARY_FIELDS}
        return cls(**{**values, "state": OperationState(row["state"])})


_SUMMARY_FIELDS = tuple(field.name for field in fields(OperationSummary))


@dataclass(frozen=True)
class PendingApproval:
    operation: OperationSummary
    check: ApprovalCheck
    decided_by: str | None = None
    """Who made the latest decision the check read (an operator may read names; the
    check itself, which the agent also asks, does not carry them)."""


@dataclass(frozen=True)
class OperationStats:
    by_tool: dict[str, dict[str, int]]
    """tool name -> state -> operations."""
    backlog: Backlog
    pending_approvals: int
    estimated: frozenset[OperationState] = frozenset()
    """The states whose figures in ``by_tool`` are estimates (committed and rejected on
    a large table), not counts; empty when every figure was counted."""


def list_operation_summaries(
    *,
    states: list[OperationState] | None = None,
    tool: str | None = None,
    since: datetime | None = None,
    within: timedelta | None = None,
    limit: int = 50,
) -> Plan[list[OperationSummary]]:
    """Operations by last change, newest first. ``within`` is measured on the database's
    clock, so a skewed operator machine cannot shift the window."""
    params = {
        "states": [str(s) for s in states] if states else None,
        "tool": tool,
        "since": since,
        "ago": within,
        "limit": limit,
    }
    if tool is None:
        rows = yield Step("list_operation_summaries", params)
    else:
        limits = tool_listing_limits(states, limit)
        rows = yield Step("list_tool_operation_summaries", params | limits)
    return [OperationSummary.from_row(row) for row in rows]


def tool_listing_limits(states: Iterable[OperationState] | None, limit: int) -> dict[str, int]:
    """The limit of each branch of a list filtered by a tool (``list_tool_operation_summaries``,
    ``console_tool_operations_page``): ``limit`` for each state group the filter asks for
    (committed, rejected, the open states), each read from its own index, 0 for the
    others, whose plans a LIMIT 0 never starts."""
    asked = set(states or OperationState)
    return {
        "committed_limit": limit if OperationState.COMMITTED in asked else 0,
        "rejected_limit": limit if OperationState.REJECTED in asked else 0,
        "open_limit": limit if asked - TERMINAL_STATES else 0,
    }


def last_escalations(
    operation_ids: list[UUID],
) -> Plan[dict[UUID, tuple[str | None, datetime]]]:
    """Each operation's latest move to ``escalated``: its reason (None when it wrote
    none) and time, in one round trip; operations never escalated are absent."""
    return (yield from _last_reasons(operation_ids, EventName.ESCALATED))


def last_dead_letters(
    operation_ids: list[UUID],
) -> Plan[dict[UUID, tuple[str | None, datetime]]]:
    """Each operation's latest ``operation.dead_lettered`` event: the consumer's reason
    for sending its message to the dead-letter queue (None when it wrote none) and
    time, in one round trip; operations the consumer never dead-lettered are absent."""
    return (yield from _last_reasons(operation_ids, EventName.DEAD_LETTERED))


def _last_reasons(
    operation_ids: list[UUID], name: EventName
) -> Plan[dict[UUID, tuple[str | None, datetime]]]:
    if not operation_ids:
        return {}
    rows = yield Step("last_reasons", {"ids": operation_ids, "name": str(name)})
    return {row["operation_id"]: (row["reason"], row["created_at"]) for row in rows}


@dataclass(frozen=True)
class EscalationFilter:
    """Which escalated operations a batch resolution selects: every given field must
    match the operation's latest escalation. A time is an instant, or a duration back
    from the database's clock (so a skewed operator machine cannot shift the window);
    ``until`` is exclusive."""

    tool: str | None = None
    reason: str | None = None
    run_id: str | None = None
    since: datetime | timedelta | None = None
    until: datetime | timedelta | None = None

    @property
    def is_empty(self) -> bool:
        return all(value is None for value in astuple(self))


@dataclass(frozen=True)
class MatchedEscalation:
    operation: OperationSummary
    reason: str | None
    escalated_at: datetime


@dataclass(frozen=True)
class EscalationSelection:
    """At most ``limit`` matching escalations, oldest escalation first, and how many
    matched in all when the database's clock read ``selected_at``."""

    escalations: list[MatchedEscalation]
    matched: int
    selected_at: datetime


def escalations_matching(where: EscalationFilter, *, limit: int) -> Plan[EscalationSelection]:
    """The escalated operations ``where`` selects, each with its latest escalation's
    reason and time, read from its newest escalation event alone."""

    def instant(value: datetime | timedelta | None) -> datetime | None:
        return value if isinstance(value, datetime) else None

    def ago(value: datetime | timedelta | None) -> timedelta | None:
        return value if isinstance(value, timedelta) else None

    rows = yield Step(
        "escalations_matching",
        {
            "tool": where.tool,
            "reason": where.reason,
            "run_id": where.run_id,
            "since": instant(where.since),
            "until": instant(where.until),
            "since_ago": ago(where.since),
            "until_ago": ago(where.until),
            "limit": limit,
        },
    )
    found = [
        MatchedEscalation(
            operation=OperationSummary.from_row(row),
            reason=row["reason"],
            escalated_at=row["escalated_at"],
        )
        for row in rows
        if row["id"] is not None
    ]
    first = rows[0]
    return EscalationSelection(
        escalations=found, matched=int(first["matched"]), selected_at=first["selected_at"]
    )


def operations_with_prefix(hex_prefix: str) -> Plan[list[UUID]]:
    """At most two operation ids that start with ``hex_prefix`` (lowercase hex digits,
    no dashes): one when a short id names a single operation, two when it is ambiguous.
    The primary key's index answers it as a range."""
    rows = yield Step("operation_ids_in_range", prefix_range(hex_prefix))
    return [row["id"] for row in rows]


def prefix_range(hex_prefix: str) -> dict[str, UUID]:
    """The lowest and the highest id that start with ``hex_prefix``; ValueError for
    anything but 1 to 32 lowercase hex digits."""
    if (
        not hex_prefix
        or len(hex_prefix) > 32
        or any(c not in "0123456789abcdef" for c in hex_prefix)
    ):
        raise ValueError(f"not the start of an operation id: {hex_prefix!r}")
    return {
        "lowest": UUID(hex_prefix.ljust(32, "0")),
        "highest": UUID(hex_prefix.ljust(32, "f")),
    }


def pending_approvals() -> Plan[list[PendingApproval]]:
    """Prepared operations that need an approval and have no valid one.

    Each candidate, read with its latest approval decision in one statement, goes
    through :func:`approval_check`, the rule the consumer applies, so what this lists is
    exactly what the consumer would refuse to execute.
    """
    key = yield from fingerprint_key()
    rows = yield Step("list_approval_candidates", {})
    pending = []
    for row in rows:
        summary = OperationSummary.from_row(row)
        latest = (
            None
            if row["approval_id"] is None
            else Approval(
                id=row["approval_id"],
                operation_id=summary.id,
                intent_hash=row["approval_intent_hash"],
                decision=row["approval_decision"],
                expires_at=row["approval_expires_at"],
                created_at=row["approval_created_at"],
            )
        )
        check = approval_check(
            latest, fingerprint=summary.input_fingerprint, now=row["checked_at"], key=key
        )
        if not check.is_valid:
            decided_by = None if latest is None else row["approval_approved_by"]
            pending.append(PendingApproval(operation=summary, check=check, decided_by=decided_by))
    return pending


def approver_of(check: ApprovalCheck) -> Plan[str | None]:
    """Who made the decision ``check`` read, for an operator's eyes; None if none."""
    if check.approval is None:
        return None
    rows = yield Step("console_operation_approvals", {"operation_id": check.approval.operation_id})
    return next((str(row["approved_by"]) for row in rows if row["id"] == check.approval.id), None)


def _about(estimate: int) -> int:
    """An estimate to three significant figures (62,776 -> 62,800)."""
    digits = len(str(abs(estimate)))
    return estimate if digits <= _ESTIMATE_DIGITS else round(estimate, _ESTIMATE_DIGITS - digits)


def operation_stats(
    exact_below: int = EXACT_SETTLED_COUNT_BELOW, sample_pages: int = SETTLED_SAMPLE_PAGES
) -> Plan[OperationStats]:
    """Operations by tool and state, the outbox backlog and the approvals waiting, at a
    cost that does not grow with the history: the open states are counted; committed
    and rejected too while the statistics say the table holds fewer than
    ``exact_below`` rows (as the dispatcher's gauge does), and past that estimated from
    a sample of about ``sample_pages`` pages, to three significant figures."""
    size = yield Step("operations_analyzed_rows", {})
    if float(size[0]["analyzed_rows"]) < exact_below:
        rows = yield Step("count_operations_by_tool_and_state", {})
        estimated: frozenset[OperationState] = frozenset()
    else:
        yield Step("transaction_without_jit", {})
        rows = yield Step("estimate_operations_by_tool_and_state", {"sample_pages": sample_pages})
        estimated = frozenset((OperationState.COMMITTED, OperationState.REJECTED))
    by_tool: dict[str, dict[str, int]] = {}
    for row in rows:
        count = int(row["operations"])
        if row.get("estimated"):
            count = _about(count)
        by_tool.setdefault(row["tool_name"], {})[row["state"]] = count
    backlog = yield from outbox_backlog()
    pending = yield from pending_approvals()
    return OperationStats(
        by_tool=by_tool, backlog=backlog, pending_approvals=len(pending), estimated=estimated
    )


def resolve_operation(
    operation_id: UUID,
    *,
    source: OperationState,
    target: OperationState,
    decision: str,
    resolved_by: str,
    evidence: str,
    provider_reference: str | None = None,
    batch_id: UUID | None = None,
) -> Plan[Operation]:
    """A person settles an operation: ``source -> target`` with an
    ``operation.resolved`` event carrying their name, their decision and their evidence.

    The evidence is the operator's own free text, written to be kept with the operation:
    it is stored whole in the event, and never logged. Evidence over
    ``RESOLUTION_EVIDENCE_LIMIT`` characters is refused, with nothing written. Moving to
    ``prepared`` queues a fresh outbox row available at once: the resolution authorizes
    a retry. ``batch_id`` names the batch resolution the operation was settled in (the
    event carries it, so a batch can be found and read back).
    """
    if not resolved_by.strip():
        raise ValueError("resolved_by must name the person who resolved the operation")
    if not evidence.strip():
        raise ValueError("a resolution needs evidence")
    if len(evidence) > RESOLUTION_EVIDENCE_LIMIT:
        raise ValueError(
            f"the evidence is {len(evidence)} characters; at most {RESOLUTION_EVIDENCE_LIMIT} "
            "are kept, and a person's words are never cut"
        )
    if not is_legal(source, target):
        raise IllegalTransition(
            f"{source} -> {target} is not a legal transition; from {source} an operation "
            f"may go to: {', '.join(legal_targets(source)) or 'nowhere (terminal)'}"
        )
    if source in FENCED_SOURCES:
        raise IllegalTransition(
            f"a person cannot resolve an operation that is {source}: a worker holds it"
        )
    logged: dict[str, lifecycle.Scalar] = {
        "from": str(source),
        "to": str(target),
        "decision": decision,
    }
    if provider_reference is not None:
        logged["provider_reference"] = provider_reference
    if batch_id is not None:
        logged["batch_id"] = str(batch_id)
    # Who and why are kept in the event, where they belong; a log line carries ids.
    stored = {**logged, "by": resolved_by, "evidence": evidence}
    retry = target is OperationState.PREPARED
    rows = yield Step(
        "transition_operation",
        {
            "id": operation_id,
            "source": str(source),
            "target": str(target),
            "lease_token": None,
            "provider_reference": provider_reference,
            "result": None,
            "error_class": None,
            # A retry the person authorized is due now, not after a lookup's backoff.
            "delay": timedelta(0) if retry else None,
            "reconcile_increment": 0,
            # A person's word moves the operation but is not a lookup: an effect that
            # may have happened stays possible, so a later failure escalates again
            # instead of ending rejected.
            "effect_disproved": False,
            "event_name": str(EventName.RESOLVED),
            "event_attributes": Jsonb(stored),
            "requeue": retry,
            # A person's word is not the provider's: a wait, if any, goes on from where
            # it was (the operation was escalated, which ended any wait).
            "waiting": str(Waiting.KEEP),
            "attempt_refund": 0,
        },
    )
    if not rows:
        current = yield from get_operation(operation_id)
        raise IllegalTransition(
            f"{current.display_id} is {current.state}, not {source}: another process moved "
            "it first; nothing was changed"
        )
    operation = Operation.model_validate(rows[0])
    lifecycle.emit(EventName.RESOLVED, operation, logged)
    return operation


@dataclass(frozen=True)
class DeadLetterDiscard:
    """What is kept of one dead letter a person discards: never its body, only its
    digest and size, with what its envelope named where it parsed."""

    message_id: str | None
    operation_ids: tuple[UUID, ...]
    tools: tuple[str, ...]
    body_sha256: str
    body_bytes: int
    death_reason: str | None
    died_at: datetime | None
    reason: str
    discarded_by: str


@dataclass(frozen=True)
class DiscardRecord:
    """One row of ``discarded_dead_letters``: the discard and who (person and database
    login) recorded it when."""

    id: int
    discard: DeadLetterDiscard
    recorded_as: str
    discarded_at: datetime


def record_discarded_dead_letters(
    discards: list[DeadLetterDiscard],
) -> Plan[list[DiscardRecord]]:
    """Record each dead letter before it is removed from the queue: committed first, so
    a discard is never a removal nobody can account for."""
    records = []
    for discard in discards:
        rows = yield Step(
            "record_discarded_dead_letter",
            {
                "message_id": discard.message_id,
                "operation_ids": list(discard.operation_ids),
                "tools": list(discard.tools),
                "body_sha256": discard.body_sha256,
                "body_bytes": discard.body_bytes,
                "death_reason": discard.death_reason,
                "died_at": discard.died_at,
                "reason": discard.reason,
                "discarded_by": discard.discarded_by,
            },
        )
        records.append(
            DiscardRecord(
                id=int(rows[0]["id"]),
                discard=discard,
                recorded_as=str(rows[0]["recorded_as"]),
                discarded_at=rows[0]["discarded_at"],
            )
        )
    return records


def list_discarded_dead_letters(limit: int) -> Plan[list[DiscardRecord]]:
    """The record of discarded dead letters, newest first."""
    rows = yield Step("list_discarded_dead_letters", {"limit": limit})
    return [
        DiscardRecord(
            id=int(row["id"]),
            discard=DeadLetterDiscard(
                message_id=row["message_id"],
                operation_ids=tuple(row["operation_ids"]),
                tools=tuple(row["tools"]),
                body_sha256=row["body_sha256"],
                body_bytes=int(row["body_bytes"]),
                death_reason=row["death_reason"],
                died_at=row["died_at"],
                reason=row["reason"],
                discarded_by=row["discarded_by"],
            ),
            recorded_as=str(row["recorded_as"]),
            discarded_at=row["discarded_at"],
        )
        for row in rows
    ]
