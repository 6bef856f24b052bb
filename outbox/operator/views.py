"""What the operator front ends read beyond one store call: the operation a short id
names, why an escalated operation was handed to a person and since when, what a dead
letter's operation has become, and each provider's breaker with the operations that
wait for it. ``outbox ops``, ``outbox providers`` and the console read them the same
way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from uuid import UUID

from outbox import store
from outbox.breaker import BreakerState, ProviderHealth
from outbox.broker import MAX_ENVELOPE_BYTES
from outbox.contracts import Registry
from outbox.errors import MalformedOperationId, OperationNotFound
from outbox.models import display_operation_id, parse_operation_id
from outbox.operator.dlq import DeadLetter
from outbox.states import OperationState
from outbox.store import Store

# The short id the console prints (`op_74ca7733`): a shorter prefix names too little to
# act on safely.
MIN_SHORT_ID = 8
_HEX = frozenset("0123456789abcdef")


def operation_id_of(runner: Store, text: str) -> UUID:
    """The operation ``text`` names: ``op_<uuid>``, a bare uuid, or the start of one
    (at least 8 hex digits, ``op_`` optional) that only one operation has, in the hot
    tables or in history: a prefix that one hot and one archived operation share is as
    ambiguous as any other."""
    given = text.strip()
    try:
        return parse_operation_id(given)
    except ValueError:
        pass
    prefix = given.lower().removeprefix("op_").replace("-", "")
    if len(prefix) < MIN_SHORT_ID or len(prefix) > 32 or not set(prefix) <= _HEX:
        raise MalformedOperationId(
            f"{given!r} is not an operation id: expected op_<uuid>, a bare uuid, or the "
            f"start of one (at least {MIN_SHORT_ID} hex digits, as the console shows it)"
        )
    matches = runner.run(store.operations_with_prefix(prefix))
    if len(matches) < 2:
        # The hot tables named at most one: history may name another (or the same
        # one, moved between the two reads).
        archived = runner.run(store.archived_ids_with_prefix(prefix))
        matches = sorted({*matches, *archived})
    if not matches:
        raise OperationNotFound(f"no operation id starts with {given!r}")
    if len(matches) > 1:
        first, second = (display_operation_id(m) for m in matches[:2])
        raise OperationNotFound(
            f"{given!r} is ambiguous: {first}, {second} and maybe more start with it; give "
            "more of the id"
        )
    return matches[0]


@dataclass(frozen=True)
class Escalation:
    reason: str
    """The ``reason`` of the move to ``escalated`` (``tampered``, ``undeliverable``,
    ``escalate_by_contract``, ...), as the policy wrote it."""
    since: datetime


def escalations(
    runner: Store, operations: Iterable[tuple[UUID, OperationState]]
) -> dict[UUID, Escalation]:
    """The latest escalation of each escalated operation among ``operations``, in one
    query that reads each one's newest escalation event alone: an operation with a long
    timeline costs what a short one does."""
    escalated = [
        operation_id for operation_id, state in operations if state is OperationState.ESCALATED
    ]
    return {
        operation_id: Escalation(reason=reason if isinstance(reason, str) else "-", since=since)
        for operation_id, (reason, since) in runner.run(store.last_escalations(escalated)).items()
    }


# What RabbitMQ's x-death reason means for an operation message.
DEATH_REASONS = {
    "rejected": "refused by a consumer",
    "delivery_limit": "out of deliveries (OUTBOX_DELIVERY_LIMIT)",
    "expired": "expired in the queue",
}


@dataclass(frozen=True)
class DeadLetterView:
    """One dead letter as a person reads it: why it died, and what became of its
    operation since."""

    message: DeadLetter
    why: str
    """The consumer's reason where it wrote one down (or where the message alone tells
    it), else what the broker says."""
    operation_state: OperationState | None
    escalation: Escalation | None


def dead_letter_views(runner: Store, messages: Iterable[DeadLetter]) -> list[DeadLetterView]:
    """Each message with its operation's state and the consumer's reason: the consumer
    writes an ``operation.dead_lettered`` event for a tool no consumer has; a body that
    is not an envelope is ``malformed`` (or ``oversized``), one whose operation does not
    exist ``unknown_operation``, as the consumer logs them. The reasons are read with
    one query for all the messages, each from its operation's newest such event alone:
    a long timeline costs what a short one does. An operation only history holds says so
    (``archived``): the consumer would refuse a requeued copy as unknown."""
    shown = [dead_letter_views_without_database(message) for message in messages]
    states: dict[UUID, OperationState] = {}
    for view in shown:
        envelope = view.message.envelope
        if envelope is not None and envelope.operation_id not in states:
            with contextlib.suppress(OperationNotFound):
                states[envelope.operation_id] = runner.run(
                    store.get_operation(envelope.operation_id)
                ).state
    reasons = runner.run(store.last_dead_letters(list(states)))
    escalated = escalations(runner, states.items())
    missing = {v.message.envelope.operation_id for v in shown if v.message.envelope} - set(states)
    archived = runner.run(store.archived_states(sorted(missing)))
    views = []
    for view in shown:
        envelope = view.message.envelope
        if envelope is None:
            views.append(view)
        elif envelope.operation_id in archived:
            views.append(replace(view, why=_archived_why(archived[envelope.operation_id])))
        elif envelope.operation_id not in states:
            views.append(replace(view, why="unknown_operation: no operation has this id"))
        else:
            reason, _ = reasons.get(envelope.operation_id, (None, None))
            views.append(
                replace(
                    view,
                    why=reason if reason is not None else view.why,
                    operation_state=states[envelope.operation_id],
                    escalation=escalated.get(envelope.operation_id),
                )
            )
    return views


def _archived_why(state: OperationState) -> str:
    return (
        f"archived: its operation settled {state} and moved to history; nothing waits for "
        "this message, and a requeued copy comes back here (unknown_operation)"
    )


def dead_letter_views_without_database(message: DeadLetter) -> DeadLetterView:
    """What the message alone says, for when the operations cannot be read."""
    if not message.parsed:
        why = "oversized" if message.body_bytes > MAX_ENVELOPE_BYTES else "malformed"
    else:
        why = _broker_says(message)
    return DeadLetterView(message=message, why=why, operation_state=None, escalation=None)


def _broker_says(message: DeadLetter) -> str:
    deaths = [
        f"{DEATH_REASONS.get(d.reason, d.reason)}, {d.count} time(s), from {d.queue}"
        for d in message.deaths
    ]
    return "; ".join(deaths) or (message.first_death_reason or "-")


@dataclass(frozen=True)
class ProviderView:
    """One provider's breaker as an operator reads it, with the operations that wait
    for the provider."""

    health: ProviderHealth
    now: datetime
    """The database's clock when the row was read: the times in ``health`` are its."""
    last_event_at: datetime | None
    tools: tuple[str, ...] | None
    """The tools of the loaded tools modules that call this provider; None when no
    tools modules are loaded, so tools cannot be mapped to providers."""
    waiting: int | None
    """Operations of those tools waiting for their provider (None as for ``tools``):
    the number ``outbox_provider_waiting_operations`` exports."""

    @property
    def retry_after_pending(self) -> bool:
        """The provider asked not to be called before a moment still ahead."""
        return self.health.not_before is not None and self.health.not_before > self.now

    @property
    def needs_attention(self) -> bool:
        """Open or half-open, held back by a Retry-After, or with operations waiting. A
        closed breaker with a streak of failures is not: the next answer forgets it."""
        return (
            self.health.state is not BreakerState.CLOSED
            or self.retry_after_pending
            or bool(self.waiting)
        )


@dataclass(frozen=True)
class ProvidersView:
    """Every provider that has a breaker row, and the operations waiting for one."""

    providers: list[ProviderView]
    waiting_by_tool: dict[str, int]
    """Operations waiting for their provider, by tool, whatever the tools modules."""
    unattributed: dict[str, int]
    """The part of ``waiting_by_tool`` no listed provider accounts for: every tool when
    no tools modules are loaded."""
    tools_loaded: bool

    @property
    def needs_attention(self) -> bool:
        return any(p.needs_attention for p in self.providers) or bool(self.waiting_by_tool)

    def named(self, provider: str) -> ProviderView | None:
        return next((p for p in self.providers if p.health.provider == provider), None)


def provider_views(runner: Store, registry: Registry | None) -> ProvidersView:
    """The breaker rows and what waits for each provider. With ``registry``, each
    tool's waiting operations count for its contract's provider, as the consumer's
    gauge counts them (a tool whose versions name two providers counts for both)."""
    rows = runner.run(store.all_providers())
    waiting = runner.run(store.waiting_operations_by_tool())
    tools_of: dict[str, set[str]] = {}
    for contract in registry or ():
        tools_of.setdefault(contract.provider_name, set()).add(contract.name)
    loaded = registry is not None
    providers = []
    accounted: set[str] = set()
    for row in rows:
        tools = sorted(tools_of.get(row.health.provider, ()))
        accounted.update(tools)
        providers.append(
            ProviderView(
                health=row.health,
                now=row.now,
                last_event_at=row.last_event_at,
                tools=tuple(tools) if loaded else None,
                waiting=sum(waiting.get(tool, 0) for tool in tools) if loaded else None,
            )
        )
    return ProvidersView(
        providers=providers,
        waiting_by_tool=dict(sorted(waiting.items())),
        unattributed={t: n for t, n in sorted(waiting.items()) if t not in accounted},
        tools_loaded=loaded,
    )
