"""Test-side RabbitMQ helpers: reading what reached a queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from outbox.broker import OperationMessage

from support.waiting import POLL_SECONDS


@dataclass(frozen=True)
class Received:
    message: AbstractIncomingMessage
    body: OperationMessage


async def read_all(
    amqp_url: str, queue: str, *, expect: int, within: float = 15.0
) -> list[Received]:
    """Every message in ``queue``, acked and parsed as the dispatcher's envelope."""
    return [
        Received(message, OperationMessage.model_validate_json(message.body))
        for message in await read_raw(amqp_url, queue, expect=expect, within=within)
    ]


async def read_raw(
    amqp_url: str, queue: str, *, expect: int, within: float = 15.0
) -> list[AbstractIncomingMessage]:
    """Every message in ``queue``, acked: waits (up to ``within`` s) until at least
    ``expect`` have arrived, then takes whatever else is ready (duplicates included).

    Callers expect only messages the broker has already confirmed, so the wait covers
    the moment a quorum queue takes to make a confirmed message visible, nothing more.
    """
    received: list[AbstractIncomingMessage] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.get_queue(queue, ensure=True)
        while True:
            message = await declared.get(no_ack=False, fail=False)
            if message is not None:
                await message.ack()
                received.append(message)
                continue
            if len(received) >= expect or loop.time() >= deadline:
                return received
            await asyncio.sleep(POLL_SECONDS)
