"""Three tools through three quorum queues (``OUTBOX_TOOL_QUEUES``) against the same
three tools through one: the broker's part of a drain, without Postgres. With
``--members``, one quorum queue with one member against the same queue with three.

    .venv/bin/python -m bench.tool_queues [--operations 30000] [--rounds 3] [--cluster]
        [--members] [--json]

Each round drains ``--operations`` messages both ways, one after the other (which goes
first alternates): one publisher with confirms and the dispatcher's message (a thin
persistent envelope, mandatory, routing key ``<tool>.v1``, the three tools in turn),
and three consumers (prefetch 256, one ack a message) that read, one queue: all three
the default queue; three queues: one each its tool's. The clock runs from the first
publish to the last ack. Topologies are declared as ``outbox migrate --broker`` does,
under names of the run's own, and deleted afterwards.

By default against ``OUTBOX_AMQP_URL`` (the local broker). With ``--cluster``, against a
private three-node cluster started on this machine (``harness.rabbit_node``), each tool
queue declared through another node so that their leaders differ (the default queue is
led by the first node).

``--members`` (on the private cluster) compares one queue two ways, both declared through
the first node with the arguments ``outbox migrate --broker`` gives the queue plus
``x-quorum-initial-group-size``: one member (every message stays on the node it came
through, as on a broker of one node) or three (each enqueue and settle replicated to
the other two nodes and written by a majority before it counts, RabbitMQ's default on a
three-node cluster).

Prints ops/s of each way per round and the medians. Every process shares this machine's
cores, the broker's nodes included: the figures are a ratio between the two ways, not
a capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import uvloop
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec

from harness.rabbit_node import rabbit_cluster
from outbox.broker import Topology, declare_topology, delete_topology
from outbox.cli import positive_int
from outbox.sandbox.scratch import topology_named

TOOLS = ("refund_a", "refund_b", "refund_c")
PREFETCH = 256
WINDOW = 1000  # publishes outstanding at once, as a dispatcher's batches of chunks keep
BODY = (
    b'{"v":1,"operation_id":"5f0c1f0e-8a51-4d4f-9d55-3b1e9e0f6a21","outbox_id":1,'
    b'"tool":"refund_a","tool_version":1,"input_fingerprint":"' + b"ab" * 32 + b'"}'
)
RESULTS = Path(__file__).parent / "results" / "tool_queues.json"
MEMBERS_RESULTS = Path(__file__).parent / "results" / "quorum_members.json"


def topology(prefix: str, *, grouped: bool) -> Topology:
    names = topology_named(prefix)
    if not grouped:
        return names
    return Topology(
        exchange=names.exchange,
        queue=names.queue,
        dead_letter_exchange=names.dead_letter_exchange,
        dead_letter_queue=names.dead_letter_queue,
        delivery_limit=names.delivery_limit,
        tool_queues=tuple((f"{names.queue}.{tool}", (tool,)) for tool in TOOLS),
    )


async def declare(urls: Sequence[str], names: Topology) -> None:
    """Each tool queue through another address (its leader, where the nodes place a
    leader on the declaring node), then the whole topology as migrate declares it."""
    for position, (queue, _) in enumerate(names.tool_queues):
        connection = await aio_pika.connect(urls[position % len(urls)])
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue(queue, durable=True, arguments=names.queue_arguments)
    connection = await aio_pika.connect(urls[0])
    async with connection:
        await declare_topology(await connection.channel(), names, reroute=True)


async def drain(urls: Sequence[str], names: Topology, operations: int) -> float:
    """Seconds from the first publish to the last ack of ``operations`` messages. On
    aiormq's channels, as the daemons publish and consume, so that the client's own
    cost per message stays small beside the broker's."""
    queues = [queue for queue, _ in names.tool_queues] or [names.queue] * len(TOOLS)
    done = asyncio.Event()
    acked = 0
    connections = []
    properties = spec.Basic.Properties(delivery_mode=2, content_type="application/json")

    try:
        for position, queue in enumerate(queues):
            connection = await aio_pika.connect(urls[position % len(urls)])
            connections.append(connection)
            channel = await (await connection.channel()).get_underlay_channel()
            await channel.basic_qos(prefetch_count=PREFETCH)

            async def on_message(message: DeliveredMessage, channel: Any = channel) -> None:
                nonlocal acked
                await channel.basic_ack(message.delivery_tag)
                acked += 1
                if acked >= operations:
                    done.set()

            await channel.basic_consume(queue, on_message)
        publisher = await aio_pika.connect(urls[0])
        connections.append(publisher)
        opened = await publisher.channel(publisher_confirms=True, on_return_raises=True)
        channel = await opened.get_underlay_channel()
        assert isinstance(channel, aiormq.Channel)
        window = asyncio.Semaphore(WINDOW)

        async def publish(number: int) -> None:
            try:
                confirmed = await channel.basic_publish(
                    BODY,
                    exchange=names.exchange,
                    routing_key=f"{TOOLS[number % len(TOOLS)]}.v1",
                    properties=properties,
                    mandatory=True,
                    wait=False,
                )
                if not isinstance(confirmed, spec.Basic.Ack):
                    raise RuntimeError(f"the broker did not take message {number}: {confirmed}")
            finally:
                window.release()

        began = time.perf_counter()
        tasks = []
        for number in range(operations):
            await window.acquire()
            tasks.append(asyncio.create_task(publish(number)))
        await asyncio.gather(*tasks)
        await done.wait()
        return time.perf_counter() - began
    finally:
        for connection in connections:
            with contextlib.suppress(Exception):
                await connection.close()


@dataclass(frozen=True)
class Way:
    """One way a drain's queues are laid out."""

    label: str
    grouped: bool = False
    members: int | None = None
    """Quorum members of the one queue; None: as ``outbox migrate --broker`` declares it
    (the cluster's size)."""

    async def declare(self, urls: Sequence[str], names: Topology) -> None:
        if self.members is None:
            await declare(urls, names)
            return
        connection = await aio_pika.connect(urls[0])
        async with connection:
            channel = await connection.channel()
            exchange = await channel.declare_exchange(
                names.exchange, aio_pika.ExchangeType.TOPIC, durable=True
            )
            arguments = {**names.queue_arguments, "x-quorum-initial-group-size": self.members}
            queue = await channel.declare_queue(names.queue, durable=True, arguments=arguments)
            await queue.bind(exchange, routing_key="#")


TOOL_WAYS = (Way("one queue"), Way("three queues", grouped=True))
MEMBER_WAYS = (Way("one member", members=1), Way("three members", members=3))


async def measure(
    urls: Sequence[str], operations: int, rounds: int, ways: Sequence[Way] = TOOL_WAYS
) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {way.label: [] for way in ways}
    for number in range(rounds):
        for way in ways if number % 2 == 0 else ways[::-1]:
            names = topology(f"bench.tq.{secrets.token_hex(3)}", grouped=way.grouped)
            try:
                await way.declare(urls, names)
                seconds = await drain(urls, names, operations)
            finally:
                await delete_topology(urls[0], names)
            rates[way.label].append(operations / seconds)
            print(f"round {number + 1}: {way.label}: {operations / seconds} ops/s", flush=True)
    return rates


@contextlib.contextmanager
def broker(cluster: bool) -> Iterator[list[str]]:
    if not cluster:
        yield [os.environ.get("OUTBOX_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")]
        return
    with rabbit_cluster(3, prefix="outbox_bq") as started:
        yield [node.url for node in started.nodes]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tool_queues", description=__doc__)
    parser.add_argument("--operations", type=positive_int, default=30_000)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument(
        "--cluster", action="store_true", help="a private three-node cluster on this machine"
    )
    parser.add_argument(
        "--members",
        action="store_true",
        help="one queue with one quorum member against three (implies --cluster)",
    )
    parser.add_argument(
        "--json", action="store_true", help=f"write {RESULTS} (with --members, {MEMBERS_RESULTS})"
    )
    args = parser.parse_args(argv)
    cluster = args.cluster or args.members
    ways = MEMBER_WAYS if args.members else TOOL_WAYS
    with broker(cluster) as urls:
        rates = uvloop.run(measure(urls, args.operations, args.rounds, ways))
    medians = {way: statistics.median(figures) for way, figures in rates.items()}
    first, second = (way.label for way in ways)
    ratio = medians[second] / medians[first]
    where = "a private three-node cluster" if cluster else "one broker node"
    print(
        f"{args.operations} operations a drain, {args.rounds} rounds, {where}, "
        f"{os.cpu_count()} cores shared by every process: median {first} "
        f"{medians[first]} ops/s, {second} {medians[second]} ops/s, ratio {ratio}"
    )
    if args.json:
        (MEMBERS_RESULTS if args.members else RESULTS).write_text(
            json.dumps(
                {
                    "operations": args.operations,
                    "rounds": args.rounds,
                    "broker": where,
                    "cores": os.cpu_count(),
                    "ops_per_second": rates,
                    "medians": medians,
                    "ratio": ratio,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
