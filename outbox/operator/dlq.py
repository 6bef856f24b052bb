"""``outbox dlq list`` and ``outbox dlq requeue``: look at and replay dead-lettered messages.

A message reaches the dead-letter queue when the consumer rejects it as poison
(x-death reason ``rejected``) or when the operations queue's delivery limit runs out
(``delivery_limit``). Both commands take messages with ``basic.get`` without acking, so
whatever they do not explicitly settle goes back to the queue: a crash or a lost
connection loses nothing.

What is printed is the thin envelope only: the message id, and the operation id, tool
and tool version when the body parses as :class:`OperationMessage` (each entry's, for a
chunk of several operations). A body that does not parse is never printed (it may hold
anything); neither are header strings that are not plain printable ASCII.

``list`` is a snapshot. Messages it took are handed back with ``basic.nack(requeue=True)``,
which adds one to a quorum queue's delivery count. The dead-letter queue has no delivery
limit on RabbitMQ 3.x, so the count is harmless there, and RabbitMQ 4.3 no longer counts
a nack. RabbitMQ 4.0-4.2 count it against their default limit of 20, and the
dead-letter queue has nowhere to send a message past it (the broker drops it): list
such a queue sparingly, or give it a much higher ``delivery-limit`` by policy.

``requeue`` publishes each selected message to the operations exchange with publisher
confirms and ``mandatory``, and acks the dead-lettered copy only after the broker
confirmed the new one: a crash in between leaves the message in both queues (the
consumer's claim makes the second delivery a counted duplicate), never in neither.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import UUID

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractExchange, AbstractIncomingMessage, AbstractQueue
from pydantic import ValidationError

from outbox.broker import (
    OperationChunk,
    OperationMessage,
    connect_for_command,
    oversized,
    parse_body,
)
from outbox.errors import ConfigurationError, OutboxError, ServiceUnavailable
from outbox.settings import Settings

T = TypeVar("T")

DEFAULT_LIST_LIMIT = 100
# Publishes awaiting their confirm at once during a requeue.
REQUEUE_WINDOW = 64
# Longest header string shown; anything longer is described, not printed.
MAX_SHOWN_CHARS = 255
# Headers the broker writes about the trip that ended here. A requeued message starts a
# new trip: if it dies again the broker writes fresh ones, and a stale copy would read
# as that trip's history.
_TRIP_HEADERS = ("x-death", "x-delivery-count")
_TRIP_HEADER_PREFIXES = ("x-first-death-", "x-last-death-")

# The broker connection or channel failed mid-command.
_BROKER_ERRORS = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
)
# What a publish with confirms and on_return_raises raises when the broker refused or
# did not confirm this one message; the channel stays usable.
_REFUSALS = (aiormq.exceptions.DeliveryError, TimeoutError)


@dataclass(frozen=True)
class Death:
    """One entry of RabbitMQ's ``x-death`` header: why, where from and how often."""

    reason: str
    queue: str
    count: int
    time: datetime | None = None
    """When the broker first dead-lettered it from this queue for this reason."""


@dataclass(frozen=True)
class DeadLetter:
    """What may be shown of one dead-lettered message, and where it would go back to."""

    message_id: str | None
    envelope: OperationMessage | None
    """A single message's envelope; None for a chunk or a body that is neither."""
    body_bytes: int
    deaths: tuple[Death, ...]
    first_death_reason: str | None
    routing_key: str
    delivery_count: int | None
    chunk: tuple[OperationMessage, ...] = ()
    """The operations of a message that carries several (OUTBOX_MESSAGE_OPERATIONS)."""

    @property
    def died_at(self) -> datetime | None:
        """When it first died (the earliest x-death time), where the broker wrote one."""
        times = [death.time for death in self.deaths if death.time is not None]
        return min(times) if times else None

    @property
    def operation_ids(self) -> tuple[UUID, ...]:
        """The operations its envelope names: one, those of a chunk, or none."""
        if self.envelope is not None:
            return (self.envelope.operation_id,)
        return tuple(entry.operation_id for entry in self.chunk)

    @property
    def tools(self) -> tuple[str, ...]:
        """The tools its envelope names, each once, in order."""
        entries = (self.envelope,) if self.envelope is not None else self.chunk
        return tuple(dict.fromkeys(entry.tool for entry in entries))

    @property
    def parsed(self) -> bool:
        """Whether the body is an envelope or a chunk of them: what a consumer can read."""
        return self.envelope is not None or bool(self.chunk)

    def as_json(self) -> dict[str, Any]:
        envelope = self.envelope
        return {
            "message_id": self.message_id,
            "envelope": None if envelope is None else _thin(envelope),
            "operations": [_thin(entry) for entry in self.chunk],
            "body": "envelope"
            if envelope is not None
            else "chunk"
            if self.chunk
            else "unparseable",
            "body_bytes": self.body_bytes,
            "deaths": [
                {"reason": death.reason, "queue": death.queue, "count": death.count}
                for death in self.deaths
            ],
            "first_death_reason": self.first_death_reason,
            "routing_key": self.routing_key,
            "delivery_count": self.delivery_count,
        }

    def line(self) -> str:
        envelope = self.envelope
        if envelope is not None:
            what = (
                f"operation_id={envelope.operation_id} tool={envelope.tool} "
                f"tool_version={envelope.tool_version}"
            )
        elif self.chunk:
            what = f"chunk of {len(self.chunk)}: " + " ".join(
                f"operation_id={entry.operation_id} tool={entry.tool} "
                f"tool_version={entry.tool_version}"
                for entry in self.chunk
            )
        else:
            what = f"body: unparseable ({self.body_bytes} bytes)"
        deaths = "; ".join(
            f"reason={death.reason} queue={death.queue} count={death.count}"
            for death in self.deaths
        )
        return (
            f"message_id={self.message_id or '-'} {what} | x-death: {deaths or '-'} | "
            f"x-first-death-reason={self.first_death_reason or '-'}"
        )


# A message taken from the dead-letter queue, with what may be shown of it.
Taken = tuple[AbstractIncomingMessage, DeadLetter]


@dataclass(frozen=True)
class Listing:
    queue: str
    count: int
    """Ready messages in the queue when the listing started."""
    messages: tuple[DeadLetter, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "count": self.count,
            "shown": len(self.messages),
            "messages": [message.as_json() for message in self.messages],
        }


@dataclass
class RequeueReport:
    queue: str
    exchange: str
    requeued: int = 0
    unparseable: int = 0
    not_selected: int = 0
    missing_ids: list[str] = field(default_factory=list)

    def text(self) -> str:
        lines = [
            f"requeued {self.requeued}, left {self.unparseable} (unparseable), "
            f"kept {self.not_selected} (not selected)"
        ]
        if self.unparseable:
            lines.append(
                f"{self.unparseable} message(s) whose body is not an operation envelope stay "
                f"in {self.queue}: a consumer would only dead-letter them again"
            )
        if self.missing_ids:
            lines.append(f"not found in {self.queue}: {' '.join(self.missing_ids)}")
        return "\n".join(lines)


class RequeueFailed(OutboxError):
    """The broker refused a republished message; it stays in the dead-letter queue."""


async def list_dead_letters(settings: Settings, *, limit: int = DEFAULT_LIST_LIMIT) -> Listing:
    """Up to ``limit`` messages from the head of the dead-letter queue, all left in it."""
    async with _dead_letter_queue(settings) as (_, queue, count):
        taken: list[AbstractIncomingMessage] = []
        try:
            # Bounded by the count at the start, so messages dead-lettered meanwhile
            # cannot keep the listing going.
            while len(taken) < min(limit, count):
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    break
                taken.append(message)
            shown = tuple(inspect(message) for message in taken)
        finally:
            await _hand_back(taken)
    return Listing(queue=settings.dead_letter_queue, count=count, messages=shown)


async def requeue_dead_letters(
    settings: Settings, *, message_ids: Collection[str] | None, limit: int | None = None
) -> RequeueReport:
    """Republish dead-lettered envelopes to the operations exchange.

    ``message_ids`` None selects every message; otherwise only those with one of these
    ids. At most ``limit`` are requeued. No more messages are taken than the queue held
    when the command started, so one that is dead-lettered again as soon as it is
    requeued cannot keep the command looping.
    """
    wanted = None if message_ids is None else frozenset(message_ids)
    report = RequeueReport(queue=settings.dead_letter_queue, exchange=settings.exchange)
    found: set[str] = set()

    def choose(message: AbstractIncomingMessage, dead: DeadLetter) -> bool:
        if wanted is not None and message.message_id not in wanted:
            report.not_selected += 1
            return False
        if message.message_id is not None:
            found.add(message.message_id)
        if not dead.parsed:
            report.unparseable += 1
            return False
        return True

    async with _dead_letter_queue(settings, publish_to=settings.exchange) as (
        exchange,
        queue,
        count,
    ):
        assert exchange is not None

        async def settle(batch: list[Taken]) -> None:
            failures = await _republish_all(exchange, batch, settings.publish_timeout)
            report.requeued += len(batch) - len(failures)
            if failures:
                raise RequeueFailed(_refusal(report, failures))

        await walk_dead_letters(
            queue, count, choose=choose, settle=settle, limit=limit, window=REQUEUE_WINDOW
        )
    if wanted is not None:
        report.missing_ids = sorted(_shown(i) or "-" for i in wanted - found)
    return report


async def walk_dead_letters(
    queue: AbstractQueue,
    count: int,
    *,
    choose: Callable[[AbstractIncomingMessage, DeadLetter], bool],
    settle: Callable[[list[Taken]], Awaitable[None]],
    limit: int | None,
    window: int,
) -> None:
    """Take messages from the head of the dead-letter queue and hand those ``choose``
    picks to ``settle``, up to ``window`` at a time; ``settle`` acks what leaves.

    No more messages are taken than ``count``, the queue's depth when the command
    started, so one dead-lettered again as soon as it is settled cannot keep the walk
    going; at most ``limit`` are picked. Every message taken and not acked (passed
    over, left by ``settle``, or in hand when something failed) goes back to the queue
    at the end, in the order it was taken.
    """
    held: list[AbstractIncomingMessage] = []
    seen = picked = 0
    try:
        while seen < count and (limit is None or picked < limit):
            room = window if limit is None else min(window, limit - picked)
            batch: list[Taken] = []
            drained = False
            while len(batch) < room and seen < count:
                message = await queue.get(no_ack=False, fail=False)
                if message is None:
                    drained = True
                    break
                seen += 1
                dead = inspect(message)
                # Held until settled: whatever goes wrong from here hands it back.
                held.append(message)
                if choose(message, dead):
                    batch.append((message, dead))
            picked += len(batch)
            if batch:
                await settle(batch)
            if drained:
                break
    finally:
        await _hand_back([message for message in held if not message.processed])


def inspect(message: AbstractIncomingMessage) -> DeadLetter:
    """What may be shown of a message; its body only if it is an operation envelope or a
    chunk of them."""
    headers = message.headers or {}
    parsed = _envelopes(message.body)
    deaths: list[Death] = []
    routing_keys: list[str] = []
    raw_deaths = headers.get("x-death")
    # Broker-written, but a publisher can set any header: take only well-formed entries.
    for entry in raw_deaths if isinstance(raw_deaths, list) else []:
        if not isinstance(entry, dict):
            continue
        count = entry.get("count")
        deaths.append(
            Death(
                reason=_shown(entry.get("reason")) or "-",
                queue=_shown(entry.get("queue")) or "-",
                count=count if isinstance(count, int) else 0,
                time=_utc(entry.get("time")),
            )
        )
        keys = entry.get("routing-keys")
        if not routing_keys and isinstance(keys, list):
            routing_keys = [key for key in keys if isinstance(key, str)]
    delivery_count = headers.get("x-delivery-count")
    return DeadLetter(
        message_id=_shown(message.message_id),
        envelope=parsed if isinstance(parsed, OperationMessage) else None,
        chunk=parsed.operations if isinstance(parsed, OperationChunk) else (),
        body_bytes=len(message.body),
        deaths=tuple(deaths),
        first_death_reason=_shown(headers.get("x-first-death-reason")),
        # x-death keeps the key the message was first published with; the message's own
        # routing key is the same unless a dead-letter routing key rewrote it.
        routing_key=routing_keys[0] if routing_keys else message.routing_key or "",
        delivery_count=delivery_count if isinstance(delivery_count, int) else None,
    )


def _utc(value: object) -> datetime | None:
    """An AMQP timestamp, as the broker writes x-death's ``time`` (whole seconds, UTC)."""
    if not isinstance(value, datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _envelopes(body: bytes) -> OperationMessage | OperationChunk | None:
    if oversized(body):
        return None
    try:
        return parse_body(body)
    except ValidationError:
        return None


def _thin(envelope: OperationMessage) -> dict[str, Any]:
    return {
        "operation_id": str(envelope.operation_id),
        "tool": envelope.tool,
        "tool_version": envelope.tool_version,
    }


def _shown(value: object) -> str | None:
    """A header or property value fit to print: short printable ASCII, else a placeholder
    that says only its size (the value itself may be anything a publisher chose)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return f"(not shown: {len(value)} bytes)"
    if value is None:
        return None
    if not isinstance(value, str):
        return f"(not shown: {type(value).__name__})"
    if value and len(value) <= MAX_SHOWN_CHARS and value.isascii() and value.isprintable():
        return value
    return f"(not shown: {len(value)} characters)"


@asynccontextmanager
async def _dead_letter_queue(
    settings: Settings, *, publish_to: str | None = None
) -> AsyncIterator[tuple[AbstractExchange | None, AbstractQueue, int]]:
    """A confirm channel on the dead-letter queue (checked to exist, never declared: a
    typo must not create an empty queue), its ready-message count, and the exchange to
    publish to when asked for (checked the same way)."""
    connection = await connect_for_command(settings)
    async with connection:
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            queue = await _existing(
                channel.get_queue(settings.dead_letter_queue),
                f"dead-letter queue {settings.dead_letter_queue!r}",
                "OUTBOX_DEAD_LETTER_QUEUE",
            )
            exchange = None
            if publish_to is not None:
                exchange = await _existing(
                    channel.get_exchange(publish_to),
                    f"exchange {publish_to!r}",
                    "OUTBOX_EXCHANGE",
                )
            declared = queue.declaration_result
            yield exchange, queue, declared.message_count or 0
        except (*_BROKER_ERRORS, TimeoutError) as failure:
            raise ServiceUnavailable(
                f"the broker failed or did not answer in time: {type(failure).__name__}. "
                "Messages not yet settled return to the dead-letter queue by themselves; run "
                "the command again"
            ) from None


async def _existing(declare: Awaitable[T], what: str, variable: str) -> T:
    try:
        result = await declare
    except aiormq.exceptions.ChannelNotFoundEntity:
        raise ConfigurationError(
            f"{what} does not exist on this broker: run `outbox migrate --broker`, or set "
            f"{variable} (or its flag) to the name the daemons use"
        ) from None
    return result


async def _republish_all(
    exchange: AbstractExchange,
    batch: Sequence[Taken],
    confirm_seconds: float,
) -> list[tuple[AbstractIncomingMessage, BaseException]]:
    """Publish the batch with every confirm outstanding at once; ack each dead-lettered
    copy as soon as its own confirm arrives. Returns the ones that were not confirmed."""

    async def one(message: AbstractIncomingMessage, dead: DeadLetter) -> None:
        await exchange.publish(
            _republished(message), dead.routing_key, mandatory=True, timeout=confirm_seconds
        )
        await message.ack()

    results = await asyncio.gather(
        *(one(message, dead) for message, dead in batch), return_exceptions=True
    )
    failures: list[tuple[AbstractIncomingMessage, BaseException]] = []
    for (message, _), result in zip(batch, results, strict=True):
        if isinstance(result, _REFUSALS):
            failures.append((message, result))
        elif isinstance(result, BaseException):
            # A lost connection or channel, or cancellation: not this message's refusal.
            raise result
    return failures


def _republished(message: AbstractIncomingMessage) -> aio_pika.Message:
    """The same body and properties, without the headers about the trip that ended here.

    ``user_id`` is dropped (the broker refuses one that is not the publishing user), as
    are ``expiration`` and ``reply_to``, which meant something only to the first trip.
    """
    headers = {
        key: value
        for key, value in (message.headers or {}).items()
        if key not in _TRIP_HEADERS and not key.startswith(_TRIP_HEADER_PREFIXES)
    }
    return aio_pika.Message(
        message.body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
    )


def _refusal(
    report: RequeueReport, failures: Sequence[tuple[AbstractIncomingMessage, BaseException]]
) -> str:
    kinds = sorted({_failure_kind(error) for _, error in failures})
    return (
        f"the broker did not confirm {len(failures)} republished message(s) "
        f"({', '.join(kinds)}); they stay in {report.queue}. Requeued {report.requeued} "
        f"before that. Check that exchange {report.exchange!r} is bound to the operations "
        "queue and that the queue is not full, then run the command again"
    )


def _failure_kind(error: BaseException) -> str:
    if isinstance(error, aiormq.exceptions.PublishError):
        return "unroutable"
    if isinstance(error, aiormq.exceptions.DeliveryError):
        return "nacked"
    return "no confirm in time"


async def _hand_back(messages: Sequence[AbstractIncomingMessage]) -> None:
    """Return messages to the queue. ``nack``, not ``reject``: on RabbitMQ 4.3+ only a
    reject counts as a failed delivery. If the channel is already gone they return by
    themselves, so a failure here loses nothing."""
    for message in messages:
        try:
            await message.nack(requeue=True)
        except _BROKER_ERRORS:
            return
