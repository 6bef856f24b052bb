"""Test-side RabbitMQ helpers: reading what reached a queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from outbox.broker import OperationChunk, OperationMessage, parse_body

from support.waiting import POLL_SECONDS


@dataclass(frozen=True)
class Received:
    """One operation that reached a queue: the message that carried it (alone, or in a
    chunk with others) and its envelope."""

    message: AbstractIncomingMessage
    body: OperationMessage


def operations_of(message: AbstractIncomingMessage) -> list[Received]:
    """The operations a message carries: one for a single envelope, each entry of a
    chunk (with its trace context left out, as a single envelope carries it in a
    header)."""
    envelope = parse_body(message.body)
    if isinstance(envelope, OperationChunk):
        return [
            Received(
                message, OperationMessage.model_validate(entry.model_dump(exclude={"traceparent"}))
            )
            for entry in envelope.operations
        ]
    return [Received(message, envelope)]


async def read_all(
    amqp_url: str, queue: str, *, expect: int, within: float = 15.0
) -> list[Received]:
    """Every operation the messages in ``queue`` carry, the messages acked: waits (up to
    ``within`` s) until at least ``expect`` operations have arrived, then takes whatever
    else is ready. A dispatcher sends one message per operation while it keeps up and
    chunks of several as a backlog forms; this reads both alike."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    received: list[Received] = []
    while True:
        for message in await read_raw(amqp_url, queue, expect=0, within=0):
            received.extend(operations_of(message))
        if len(received) >= expect or loop.time() >= deadline:
            return received
        await asyncio.sleep(POLL_SECONDS)


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


async def wait_for_dead_letter_queue(amqp_url: str, queue: str) -> None:
    """A probe published straight to the dead-letter queue, confirmed and read back.

    The broker retries an unconfirmed dead-lettering only after three minutes
    (``dead_letter_worker_publisher_confirm_timeout``), so a message rejected while the
    just-declared quorum queue is still electing its leader can miss a test's deadline.
    A confirmed probe shows the queue is taking messages. For an empty queue only: the
    probe is read back with whatever else the queue holds.
    """
    assert await message_count(amqp_url, queue) == 0, f"{queue} is not empty"
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(on_return_raises=True)
        await channel.default_exchange.publish(aio_pika.Message(b"probe"), routing_key=queue)
    probe = await read_raw(amqp_url, queue, expect=1, within=30)
    assert [m.body for m in probe] == [b"probe"]


async def message_count(amqp_url: str, queue: str) -> int:
    """How many messages ``queue`` holds, none of them taken."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result.message_count or 0


async def wait_for_messages(amqp_url: str, queue: str, *, count: int, within: float = 30) -> None:
    """Until ``queue`` holds at least ``count`` messages, none of them taken."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        held = await message_count(amqp_url, queue)
        if held >= count:
            return
        if loop.time() >= deadline:
            raise AssertionError(f"{queue} held {held} of {count} messages after {within} s")
        await asyncio.sleep(POLL_SECONDS)
