"""``outbox dlq discard``: take poison out of the dead-letter queue, on the record.

A body that is not an operation envelope can only die again if requeued, so before this
the one way out was ``rabbitmqctl purge_queue``, which takes everything and keeps no
trace. A discard takes only the messages it selects (by id, by tool, by RabbitMQ's
death reason, or every malformed one), and removes each only after a row for it in
``discarded_dead_letters`` is committed: its body's SHA-256 and size (never the body),
the operations and tools its envelope named, when and why it died, the reason a person
gave and their name; the database adds its login and the time. A crash between the two
leaves the message in the queue with a record saying it was discarded: discarding it
again records it twice, never removes it unrecorded.

No operation is lost with its message: Postgres, not the broker, holds every operation,
and :func:`discard_fate` says what becomes of each (a prepared one is queued again by
the consumer's stale sweep, an escalated one stays escalated for a person). Messages
are taken with ``basic.get`` without ack, as ``list`` and ``requeue`` take them
(:mod:`outbox.operator.dlq`): what is not discarded goes back.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from outbox import store
from outbox.connections import command_transaction
from outbox.errors import ConfigurationError, OutboxError
from outbox.operator.dlq import (
    _BROKER_ERRORS,
    DeadLetter,
    Taken,
    _dead_letter_queue,
    _shown,
    walk_dead_letters,
)
from outbox.operator.render import instant, stamp
from outbox.operator.views import DeadLetterView
from outbox.settings import Settings
from outbox.states import OperationState
from outbox.store import DeadLetterDiscard, DiscardRecord, Store
from outbox.text import printable

S = OperationState
# Messages recorded in one transaction, then removed.
DISCARD_WINDOW = 64
# x-death reasons a selection may name (outbox.operator.views.DEATH_REASONS).
DEATH_REASONS = ("rejected", "delivery_limit", "expired")

Recorder = Callable[[list[DeadLetterDiscard]], Awaitable[list[DiscardRecord]]]


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def recorder(settings: Settings) -> Recorder:
    """Records discards in one committed transaction of their own, on a worker thread
    (the broker's channel stays on the event loop)."""

    async def record(discards: list[DeadLetterDiscard]) -> list[DiscardRecord]:
        def write() -> list[DiscardRecord]:
            with command_transaction(settings) as connection:
                return Store(connection).run(store.record_discarded_dead_letters(discards))

        return await asyncio.to_thread(write)

    return record


class DiscardIncomplete(OutboxError):
    """Discards were recorded, but the broker failed before it removed the messages."""


@dataclass(frozen=True)
class Selection:
    """Which dead letters to discard: every criterion given must hold."""

    message_ids: frozenset[str] | None = None
    malformed: bool = False
    """Only bodies that are neither an envelope nor a chunk of them."""
    tool: str | None = None
    """Only envelopes (or chunks) whose every operation is of this tool."""
    death_reason: str | None = None
    """Only messages RabbitMQ dead-lettered for this reason (x-death)."""
    bodies: frozenset[str] | None = None
    """Only bodies with these SHA-256 digests: the ones a preview showed (the console)."""

    def shown_in(self, digests: Collection[str]) -> Selection:
        """This selection, narrowed to the bodies a preview showed."""
        return replace(self, bodies=frozenset(digests))

    @classmethod
    def of(
        cls,
        *,
        message_ids: Collection[str] | None = None,
        malformed: bool = False,
        tool: str | None = None,
        death_reason: str | None = None,
    ) -> Selection:
        selection = cls(
            message_ids=None if message_ids is None else frozenset(message_ids),
            malformed=malformed,
            tool=tool,
            death_reason=death_reason,
        )
        if not (message_ids or malformed or tool or death_reason):
            raise ConfigurationError(
                "choose what to discard: --message-id, --malformed, --tool or --death-reason"
            )
        if malformed and tool is not None:
            raise ConfigurationError(
                "a malformed body names no tool: --malformed or --tool, not both"
            )
        return selection

    def matches(self, message: AbstractIncomingMessage, letter: DeadLetter) -> bool:
        if self.bodies is not None and digest(message.body) not in self.bodies:
            return False
        if self.message_ids is not None and message.message_id not in self.message_ids:
            return False
        if self.malformed and letter.parsed:
            return False
        if self.tool is not None and (
            not letter.tools or any(tool != self.tool for tool in letter.tools)
        ):
            return False
        return self.death_reason is None or any(
            death.reason == self.death_reason for death in letter.deaths
        )


@dataclass(frozen=True)
class Candidate:
    """A selected dead letter: what may be shown of it, and its body's digest."""

    letter: DeadLetter
    body_sha256: str

    def discard(self, *, reason: str, by: str) -> DeadLetterDiscard:
        letter = self.letter
        return DeadLetterDiscard(
            message_id=letter.message_id,
            operation_ids=letter.operation_ids,
            tools=letter.tools,
            body_sha256=self.body_sha256,
            body_bytes=letter.body_bytes,
            death_reason=letter.first_death_reason
            or (letter.deaths[0].reason if letter.deaths else None),
            died_at=letter.died_at,
            reason=reason,
            discarded_by=by,
        )


@dataclass
class DiscardReport:
    queue: str
    dry_run: bool
    selected: list[Candidate] = field(default_factory=list)
    records: list[DiscardRecord] = field(default_factory=list)
    kept: int = 0
    missing_ids: list[str] = field(default_factory=list)


async def discard_dead_letters(
    settings: Settings,
    selection: Selection,
    *,
    record: Recorder | None,
    reason: str,
    by: str,
    limit: int | None = None,
) -> DiscardReport:
    """Discard the selected dead letters, each recorded by ``record`` (committed) before
    it is acked; ``record`` None is a dry run: what would go, all left in the queue.

    No more messages are taken than the queue held when the command started, and at
    most ``limit`` are selected."""
    report = DiscardReport(queue=settings.dead_letter_queue, dry_run=record is None)
    found: set[str] = set()

    def choose(message: AbstractIncomingMessage, letter: DeadLetter) -> bool:
        if not selection.matches(message, letter):
            report.kept += 1
            return False
        if message.message_id is not None:
            found.add(message.message_id)
        report.selected.append(Candidate(letter, digest(message.body)))
        return True

    async def settle(window: list[Taken]) -> None:
        if record is None:
            return
        chosen = report.selected[-len(window) :]
        report.records += await record([c.discard(reason=reason, by=by) for c in chosen])
        await _remove([message for message, _ in window], report)

    async with _dead_letter_queue(settings) as (_, queue, count):
        await walk_dead_letters(
            queue, count, choose=choose, settle=settle, limit=limit, window=DISCARD_WINDOW
        )
    if selection.message_ids is not None:
        report.missing_ids = sorted(_shown(i) or "-" for i in selection.message_ids - found)
    return report


async def _remove(window: list[AbstractIncomingMessage], report: DiscardReport) -> None:
    """Ack what was recorded. A broker failure now leaves recorded messages in the
    queue: said as such, since the command's generic broker error would not."""
    for position, message in enumerate(window):
        try:
            await message.ack()
        except _BROKER_ERRORS:
            left = len(window) - position
            raise DiscardIncomplete(
                f"{len(report.records)} discard(s) recorded, but the broker failed before "
                f"{left} of them left {report.queue}: those are back in the queue, recorded "
                "as discarded. Run the command again to remove them (each gets a second "
                "record)"
            ) from None


def discard_fate(view: DeadLetterView) -> str:
    """What becomes of a discarded dead letter's operation: a discard removes a message,
    never an operation, and the database says what waits for whom."""
    letter = view.message
    if not letter.parsed:
        return "no operation: the body is not an operation envelope"
    if letter.chunk:
        return (
            f"a chunk of {len(letter.chunk)} operations: each is settled from the database, "
            "not from this message (`outbox ops show` each)"
        )
    if view.why.startswith("unknown_operation"):
        return "no operation has this id: nothing waits for this message"
    if view.why.startswith("archived"):
        return "its operation settled and moved to history: nothing waits for this message"
    state, escalation = view.operation_state, view.escalation
    if escalation is not None:
        return (
            f"its operation stays escalated ({printable(escalation.reason)}): resolve it with "
            "`outbox ops resolve`"
        )
    if state is None:
        return "its operation could not be read: check it with `outbox ops show`"
    if state is S.PREPARED:
        return (
            "its operation is prepared: the consumer queues it again once no message has "
            "reached it for OUTBOX_REQUEUE_STALE_AFTER, and escalates it after "
            "OUTBOX_UNDELIVERABLE_AFTER_REQUEUES refusals"
        )
    if state in (S.IN_FLIGHT, S.OUTCOME_UNKNOWN):
        return f"its operation is {state}: the reconciler settles it from the database"
    return f"its operation is already {state}: the message was redundant"


def report_text(report: DiscardReport, views: list[DeadLetterView]) -> str:
    verb = "would discard" if report.dry_run else "discarded"
    lines = [
        f"{verb} {len(report.selected)} dead letter(s) from {report.queue}, kept {report.kept}"
    ]
    for position, (candidate, view) in enumerate(zip(report.selected, views, strict=True)):
        lines.append(candidate.letter.line())
        died = candidate.letter.died_at
        lines.append(
            f"  body sha256={candidate.body_sha256} ({candidate.letter.body_bytes} bytes), "
            f"died {stamp(died) if died else 'at an unknown time'}"
        )
        lines.append(f"  {discard_fate(view)}")
        if position < len(report.records):
            record = report.records[position]
            lines.append(f"  recorded as discard {record.id} at {stamp(record.discarded_at)}")
    if report.missing_ids:
        lines.append(f"not found in {report.queue}: {' '.join(report.missing_ids)}")
    if report.dry_run and report.selected:
        lines.append("dry run: nothing was discarded; run again with --yes to discard these")
    return "\n".join(lines)


def report_json(report: DiscardReport, views: list[DeadLetterView]) -> dict[str, Any]:
    messages = []
    for position, (candidate, view) in enumerate(zip(report.selected, views, strict=True)):
        record = report.records[position] if position < len(report.records) else None
        messages.append(
            {
                **candidate.letter.as_json(),
                "died_at": instant(candidate.letter.died_at),
                "body_sha256": candidate.body_sha256,
                "why": view.why,
                "operation_state": None
                if view.operation_state is None
                else str(view.operation_state),
                "fate": discard_fate(view),
                "record_id": None if record is None else record.id,
            }
        )
    return {
        "queue": report.queue,
        "dry_run": report.dry_run,
        "selected": len(report.selected),
        "discarded": len(report.records),
        "kept": report.kept,
        "missing_ids": report.missing_ids,
        "messages": messages,
    }


def record_json(record: DiscardRecord) -> dict[str, Any]:
    discard = record.discard
    return {
        "id": record.id,
        "message_id": discard.message_id,
        "operation_ids": [str(i) for i in discard.operation_ids],
        "tools": list(discard.tools),
        "body_sha256": discard.body_sha256,
        "body_bytes": discard.body_bytes,
        "death_reason": discard.death_reason,
        "died_at": instant(discard.died_at),
        "reason": discard.reason,
        "discarded_by": discard.discarded_by,
        "recorded_as": record.recorded_as,
        "discarded_at": instant(record.discarded_at),
    }


def records_text(records: list[DiscardRecord]) -> str:
    if not records:
        return "no dead letter has been discarded"
    lines = []
    for record in records:
        discard = record.discard
        what = (
            " ".join(f"op_{i}" for i in discard.operation_ids)
            if discard.operation_ids
            else "body not an envelope"
        )
        lines.append(
            f"{record.id} {stamp(record.discarded_at)} "
            f"by {printable(discard.discarded_by)} (login {printable(record.recorded_as)}) "
            f"message_id={printable(discard.message_id or '-')} "
            f"{what} sha256={discard.body_sha256} ({discard.body_bytes} bytes) "
            f"died={stamp(discard.died_at)} "
            f"death_reason={printable(discard.death_reason or '-')}"
        )
        lines.append(f"  reason: {printable(discard.reason)}")
    return "\n".join(lines)
