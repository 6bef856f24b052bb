"""The consumers' side of the broker, as an operator reads it: how many messages wait in
the operations queue and how many consumers are connected to take them. A stopped
consumer shows here (no consumer, messages piling up) before any alert fires.

Read with a passive declare, which neither creates the queue nor changes it: the
broker answers with its ready-message and consumer counts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiormq.exceptions

from outbox.broker import connect_for_command
from outbox.errors import ServiceUnavailable
from outbox.settings import Settings


@dataclass(frozen=True)
class QueueState:
    queue: str
    messages: int
    """Ready messages: not yet delivered to a consumer, or given back by one."""
    consumers: int


async def operations_queue(settings: Settings, *, seconds: float) -> QueueState:
    """The operations queue's counts, or :class:`ServiceUnavailable` saying why not
    within ``seconds`` (connecting included)."""
    try:
        async with asyncio.timeout(seconds):
            return await _read(settings)
    except TimeoutError:
        raise ServiceUnavailable(f"the broker did not answer within {seconds:g} s") from None


async def _read(settings: Settings) -> QueueState:
    connection = await connect_for_command(settings)
    async with connection:
        try:
            channel = await connection.channel()
            queue = await channel.get_queue(settings.queue, ensure=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise ServiceUnavailable(
                f"the broker has no queue {settings.queue!r} (OUTBOX_QUEUE): run `outbox "
                "migrate --broker`, or set OUTBOX_QUEUE to the name the daemons use"
            ) from None
        except (aiormq.exceptions.AMQPError, ConnectionError) as failure:
            raise ServiceUnavailable(f"the broker failed: {type(failure).__name__}") from None
        declared = queue.declaration_result
        return QueueState(
            queue=settings.queue,
            messages=declared.message_count or 0,
            consumers=declared.consumer_count or 0,
        )
