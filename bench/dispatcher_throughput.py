"""bench/dispatcher.py's first two phases: the raw aio-pika limit (no database), and the
dispatcher draining a backlog of recorded decisions."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any
from uuid import uuid4

import aio_pika
from aio_pika.abc import AbstractExchange

from bench.dispatcher_support import (
    DRAIN_CONNECT_ATTEMPTS,
    NAME_PREFIX,
    ROUTING_KEY,
    TOOL,
    WARMUP_MESSAGES,
    HistogramSnapshot,
    publish_state,
    purge,
    queue_depth,
)
from dispatcher.daemon import Dispatcher
from dispatcher.publisher import Publisher, encode
from outbox import Settings
from outbox.broker import Topology, declare_topology
from outbox.metrics import MetricNames
from outbox.store import ClaimedRow


def synthetic_rows(count: int, first_id: int = 1) -> list[ClaimedRow]:
    """Rows like claim_outbox_batch returns for record_decision's send_refund decisions."""
    return [
        ClaimedRow(
            id=first_id + n,
            operation_id=uuid4(),
            routing_key=ROUTING_KEY,
            traceparent=None,
            publish_attempts=0,
            waited_seconds=0.0,
            tool_name=TOOL,
            tool_version=1,
            input_fingerprint=hashlib.sha256(f"bench {first_id + n}".encode()).hexdigest(),
        )
        for n in range(count)
    ]


def aio_pika_message(row: ClaimedRow) -> aio_pika.Message:
    """The dispatcher's message for ``row``, as aio-pika's own Message type."""
    encoded = encode(row)
    props = encoded.properties
    return aio_pika.Message(
        encoded.body,
        content_type=props.content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=props.message_id,
        correlation_id=props.correlation_id,
        type=props.message_type,
        app_id=props.app_id,
        headers=props.headers,
    )


async def publish_windowed(
    exchange: AbstractExchange, messages: list[aio_pika.Message], window: int
) -> float:
    """Every confirm of a window outstanding at once, then the next window: msgs/s."""
    started = time.perf_counter()
    for start in range(0, len(messages), window):
        tasks = [
            asyncio.ensure_future(
                exchange.publish(message, routing_key=ROUTING_KEY, mandatory=True)
            )
            for message in messages[start : start + window]
        ]
        await asyncio.gather(*tasks)  # a nack or a return raises
    return len(messages) / (time.perf_counter() - started)


async def publish_serial(exchange: AbstractExchange, messages: list[aio_pika.Message]) -> float:
    started = time.perf_counter()
    for message in messages:
        await exchange.publish(message, routing_key=ROUTING_KEY, mandatory=True)
    return len(messages) / (time.perf_counter() - started)


async def publish_with_publisher(settings: Settings, rows: list[ClaimedRow]) -> tuple[float, int]:
    """The dispatcher's Publisher.publish in batches, no database: (msgs/s, failures)."""
    publisher = Publisher(
        settings.amqp_url.get_secret_value(),
        settings.amqp_heartbeat,
        Topology.from_settings(settings),
        connection_name=f"{NAME_PREFIX} publisher",
        declare_topology=settings.declare_topology,
    )
    await publisher.connect()
    failed = 0
    try:
        started = time.perf_counter()
        for start in range(0, len(rows), settings.batch_size):
            outcome = await publisher.publish(
                rows[start : start + settings.batch_size], confirm_within=settings.publish_timeout
            )
            failed += len(outcome.failed)
        rate = len(rows) / (time.perf_counter() - started)
    finally:
        await publisher.close()
    return rate, failed


async def raw_phase(settings: Settings, messages: int, serial_messages: int) -> dict[str, Any]:
    topology = Topology.from_settings(settings)
    amqp_url = settings.amqp_url.get_secret_value()
    result: dict[str, Any] = {}
    await purge(amqp_url, topology)

    rows = synthetic_rows(messages)
    started = time.perf_counter()
    pipelined = [aio_pika_message(row) for row in rows]
    result["build_message_per_s"] = messages / (time.perf_counter() - started)
    serial = [aio_pika_message(row) for row in synthetic_rows(serial_messages, messages + 1)]
    result["message_body_bytes"] = len(pipelined[0].body)

    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        transport = connection.transport
        if transport is not None:
            version = transport.connection.server_properties.get("version")
            result["rabbitmq_server"] = version.decode() if isinstance(version, bytes) else version
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        declared = await declare_topology(channel, topology)
        warmup = [aio_pika_message(row) for row in synthetic_rows(WARMUP_MESSAGES, 20 * messages)]
        await publish_windowed(declared.exchange, warmup, settings.batch_size)
        await declared.queue.purge()
        result["pipelined_per_s"] = await publish_windowed(
            declared.exchange, pipelined, settings.batch_size
        )
        result["pipelined_messages"] = messages
        await declared.queue.purge()
        result["serial_per_s"] = await publish_serial(declared.exchange, serial)
        result["serial_messages"] = serial_messages
        await declared.queue.purge()

    rate, failed = await publish_with_publisher(settings, synthetic_rows(messages, 10 * messages))
    result["publisher_per_s"] = rate
    result["publisher_failed"] = failed
    await purge(amqp_url, topology)
    return result


async def raw_again(settings: Settings, messages: int) -> float:
    """The pipelined raw figure once more (after the drain), so the drain's ratio is taken
    against the raw limit on both sides of it: the machine's load drifts."""
    topology = Topology.from_settings(settings)
    amqp_url = settings.amqp_url.get_secret_value()
    messages_out = [aio_pika_message(row) for row in synthetic_rows(messages, 30 * messages)]
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        declared = await declare_topology(channel, topology)
        await declared.queue.purge()
        rate = await publish_windowed(declared.exchange, messages_out, settings.batch_size)
        await declared.queue.purge()
    return rate


async def drain_phase(settings: Settings, messages: int) -> dict[str, Any]:
    topology = Topology.from_settings(settings)
    amqp_url = settings.amqp_url.get_secret_value()
    await purge(amqp_url, topology)
    dispatcher = Dispatcher(settings)
    dispatcher.connect_attempts = DRAIN_CONNECT_ATTEMPTS
    started = time.perf_counter()
    report = await dispatcher.drain()
    elapsed = time.perf_counter() - started
    batches = HistogramSnapshot.collect(
        dispatcher.metrics.registry, MetricNames.DISPATCHER_BATCH_SIZE
    )

    failures: list[str] = []
    rows, published = await asyncio.to_thread(publish_state, settings.libpq_url)
    # Passive declare reports the quorum queue's count exactly; allow a moment anyway.
    depth = 0
    deadline = time.monotonic() + 5
    while True:
        depth = await queue_depth(amqp_url, topology.queue)
        if depth >= messages or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    if report.published != messages or report.failed:
        failures.append(
            f"drain: published={report.published} failed={report.failed}, expected {messages}"
        )
    if (rows, published) != (messages, messages):
        failures.append(f"drain: {published} of {rows} outbox rows published, expected {messages}")
    if depth != messages:
        failures.append(f"drain: the queue holds {depth} messages, expected {messages}")
    await purge(amqp_url, topology)
    return {
        "messages": messages,
        "seconds": elapsed,
        "per_s": messages / elapsed,
        "published": report.published,
        "failed": report.failed,
        "batches": int(batches.count),
        "rows_published_in_db": published,
        "queue_depth_after": depth,
        "failures": failures,
    }
