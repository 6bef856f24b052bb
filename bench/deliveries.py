"""What the consumer spends per delivery before its handler runs, in isolation.

    .venv/bin/python -m bench.deliveries [--deliveries 20000] [--rounds 7] [--burst 30]

Two paths from aiormq's consumer callback to a running handler, alternating, on uvloop,
with synthetic deliveries in bursts (30 is a one-operation-per-message drain's mean at
prefetch 256) and a handler that returns at once:

- ``queue.consume``: what the consumer did until 2026-12-04: aio-pika's wrapper builds an
  ``IncomingMessage`` and awaits the callback in a task of its own, and the callback
  starts the handler's task and awaits it shielded.
- ``raw``: what it does now: the channel's callback wraps the frame in a
  ``consumer.deliveries.Delivery`` and starts the handler's task.

Prints the median process CPU µs per delivery of each, and each round's. The figure is
only the dispatch: the rest of a delivery's cost is the same on both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

import uvloop
from aio_pika.abc import AbstractIncomingMessage
from aio_pika.queue import consumer as aio_pika_consumer
from aiormq.abc import AbstractChannel, DeliveredMessage
from pamqp import commands as spec
from pamqp.header import ContentHeader

from consumer.deliveries import Delivery
from outbox.cli import positive_int


def synthetic(
    tag: int,
    *,
    channel: AbstractChannel | None = None,
    headers: dict[str, Any] | None = None,
    message_id: str | None = None,
) -> DeliveredMessage:
    """A delivery with the properties the dispatcher sets on a one-operation message
    (``message_id`` by default ``outbox-<tag>``)."""
    properties = spec.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=f"outbox-{tag}" if message_id is None else message_id,
        correlation_id="5f0c1f0e-8a51-4d4f-9d55-3b1e9e0f6a21",
        message_type="outbox.operation",
        app_id="effect-outbox",
        headers=headers,
    )
    return DeliveredMessage(
        delivery=spec.Basic.Deliver(
            consumer_tag="ctag", delivery_tag=tag, routing_key="noop.v1", exchange="x"
        ),
        header=ContentHeader(body_size=160, properties=properties),
        body=b'{"v":1}',
        channel=cast(AbstractChannel, channel),
    )


async def dispatch(path: str, deliveries: list[DeliveredMessage], burst: int) -> float:
    """CPU µs per delivery from the channel's callback to the handler's return."""
    handled = 0
    handlers: set[asyncio.Task[None]] = set()

    async def handle(_: object) -> None:
        nonlocal handled
        handled += 1

    def start(message: object) -> asyncio.Task[None]:
        handling = asyncio.create_task(handle(message))
        handlers.add(handling)
        handling.add_done_callback(handlers.discard)
        return handling

    async def shielded(message: AbstractIncomingMessage) -> None:
        await asyncio.shield(start(message))

    async def raw(delivered: DeliveredMessage) -> None:
        start(Delivery(delivered))

    callback: Callable[[DeliveredMessage], Coroutine[Any, Any, Any]] = (
        functools.partial(aio_pika_consumer, shielded, no_ack=False)
        if path == "queue.consume"
        else raw
    )
    loop = asyncio.get_running_loop()
    began = time.process_time()
    for start_at in range(0, len(deliveries), burst):
        # aiormq runs each delivery's callback as a task of the channel.
        await asyncio.gather(
            *(loop.create_task(callback(d)) for d in deliveries[start_at : start_at + burst])
        )
        await asyncio.gather(*handlers)
    spent = time.process_time() - began
    if handled != len(deliveries):
        raise RuntimeError(f"{handled} of {len(deliveries)} deliveries handled")
    return spent / len(deliveries) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=positive_int, default=20_000)
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--burst", type=positive_int, default=30)
    args = parser.parse_args()
    deliveries = [synthetic(tag) for tag in range(1, args.deliveries + 1)]
    paths = ("queue.consume", "raw")
    figures: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(args.rounds):
        for path in paths:
            figures[path].append(uvloop.run(dispatch(path, deliveries, args.burst)))
    for path in paths:
        rounds = ", ".join(f"{value:.1f}" for value in figures[path])
        print(f"{path:14} {statistics.median(figures[path]):6.1f} µs per delivery ({rounds})")


if __name__ == "__main__":
    main()
