"""Running the consumer inside a test, and publishing raw messages to its queue."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import aio_pika
import psycopg

from consumer.worker import Consumer
from outbox import Operation, OperationState, Registry, Settings
from outbox import store as outbox_store
from outbox.models import OperationEvent
from outbox.store import Store

from support.waiting import eventually


@contextlib.asynccontextmanager
async def running_consumer(settings: Settings, registry: Registry) -> AsyncIterator[Consumer]:
    consumer = Consumer(settings, registry)
    task = asyncio.create_task(consumer.run())

    async def ready() -> bool:
        if task.done():
            task.result()
            raise AssertionError("the consumer stopped before it was ready")
        return consumer.healthy()

    try:
        await eventually(ready, within=20, what="the consumer to be ready")
        yield consumer
    finally:
        consumer.stop()
        await asyncio.wait_for(task, timeout=20)


def operation(database_url: str, operation_id: UUID) -> Operation:
    with psycopg.connect(database_url) as connection:
        return Store(connection).run(outbox_store.get_operation(operation_id))


def events(database_url: str, operation_id: UUID) -> list[OperationEvent]:
    with psycopg.connect(database_url) as connection:
        return Store(connection).run(outbox_store.events(operation_id))


def event_names(database_url: str, operation_id: UUID) -> list[str]:
    return [event.name for event in events(database_url, operation_id)]


def in_state(database_url: str, operation_id: UUID, *states: OperationState) -> Any:
    async def check() -> bool:
        current = await asyncio.to_thread(operation, database_url, operation_id)
        return current.state in states

    return check


async def publish_raw(
    amqp_url: str, exchange: str, body: bytes, routing_key: str = "send_refund.v1"
) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        # A body the exchange cannot route comes back; raising turns a test that
        # published before its queue was bound into a clear error, not a lost message.
        channel = await connection.channel(on_return_raises=True)
        target = await channel.get_exchange(exchange)
        await target.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=routing_key,
            mandatory=True,
        )
