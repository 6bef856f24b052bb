"""The minimal pipeline: a hand-written relay and consumer with no guarantees, the
physical limit the others are measured against."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

import aio_pika
import psycopg

from bench.systems.base import (
    INBOX_BATCH,
    READY,
    Close,
    Daemon,
    Enqueue,
    InboxSystem,
    ready_marker,
    topology_for,
)
from outbox.broker import Topology, declare_topology, delete_topology
from outbox.cli import run_async

MINIMAL_BATCH = 200
MINIMAL_PREFETCH = 500

MINIMAL_DDL = """
CREATE TABLE mini_outbox (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key           uuid NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at  timestamptz
);
CREATE INDEX mini_outbox_pending ON mini_outbox (id) WHERE published_at IS NULL;
CREATE FUNCTION mini_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('mini_pending', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER mini_notify AFTER INSERT ON mini_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION mini_notify();
"""
MINIMAL_CLAIM = """
SELECT id, key FROM mini_outbox
WHERE published_at IS NULL
ORDER BY id
LIMIT %s
FOR UPDATE SKIP LOCKED
"""
MINIMAL_MARK = "UPDATE mini_outbox SET published_at = clock_timestamp() WHERE id = ANY(%s)"


@dataclass
class Minimal(InboxSystem):
    """A hand-written pipeline with no guarantees, the physical limit: a relay claims
    rows (SKIP LOCKED, LISTEN/NOTIFY), publishes them with every confirm outstanding,
    marks them; a consumer inserts each burst of deliveries into the inbox in one
    statement and acks the burst with one multiple-ack."""

    name: str = "minimal"
    label: str = "minimal pipeline (no guarantees)"
    uses_broker: bool = True

    def topology(self) -> Topology:
        return topology_for(self.context.names(self.name))

    def set_up(self) -> str:
        url = super().set_up()
        with contextlib.suppress(Exception):
            run_async(delete_topology(self.context.amqp_url, self.topology()))
        return url

    def install(self, url: str) -> None:
        with psycopg.connect(url) as connection:
            connection.execute(MINIMAL_DDL)

    def tear_down(self) -> None:
        super().tear_down()
        with contextlib.suppress(Exception):
            run_async(delete_topology(self.context.amqp_url, self.topology()))

    @contextlib.contextmanager
    def backlog(self, url: str, count: int) -> Iterator[bool]:
        with psycopg.connect(url, autocommit=True) as connection, connection.transaction():
            connection.execute(
                "INSERT INTO mini_outbox (key) "
                "SELECT gen_random_uuid() FROM generate_series(1, %s)",
                (count,),
            )
            yield True

    async def writer(self, url: str) -> tuple[Enqueue, Close]:
        # Every writer commits each decision as one statement in autocommit.
        connection = await psycopg.AsyncConnection.connect(url, autocommit=True)

        async def enqueue(n: int) -> str:
            key = uuid4()
            await connection.execute("INSERT INTO mini_outbox (key) VALUES (%s)", (key,))
            return str(key)

        return enqueue, connection.close

    def daemons(self, url: str) -> list[list[Daemon]]:
        env = dict(os.environ)
        return [
            [
                Daemon(
                    "consumers",
                    "consumer",
                    self.context.child(self.name, "consumer", url),
                    READY,
                    env,
                )
            ],
            [
                Daemon(
                    "dispatcher", "relay", self.context.child(self.name, "relay", url), READY, env
                )
            ],
        ]

    def child(self, role: str, url: str) -> Coroutine[Any, Any, None]:
        if role == "relay":
            return self.relay(url)
        if role == "consumer":
            return self.consumer(url)
        raise SystemExit(f"the minimal pipeline has no child {role!r}")

    async def relay(self, url: str) -> None:
        """Claim, publish with every confirm outstanding, mark, commit; woken by NOTIFY."""
        topology = self.topology()
        listener = await psycopg.AsyncConnection.connect(url, autocommit=True)
        await listener.execute("LISTEN mini_pending")
        database = await psycopg.AsyncConnection.connect(url)
        connection = await aio_pika.connect(self.context.amqp_url, timeout=10)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await declare_topology(channel, topology)
        raw = await channel.get_underlay_channel()
        wake = asyncio.Event()

        async def forward() -> None:
            async for _ in listener.notifies():
                wake.set()

        forwarding = asyncio.create_task(forward())
        properties = aio_pika.Message(
            b"", delivery_mode=aio_pika.DeliveryMode.PERSISTENT
        ).properties
        ready_marker()
        while not forwarding.done():
            wake.clear()
            while True:
                async with database.transaction():
                    cursor = await database.execute(MINIMAL_CLAIM, (MINIMAL_BATCH,))
                    rows = await cursor.fetchall()
                    if rows:
                        await asyncio.gather(
                            *(
                                raw.basic_publish(
                                    str(key).encode(),
                                    exchange=topology.exchange,
                                    routing_key="noop.v1",
                                    properties=properties,
                                    mandatory=True,
                                )
                                for _, key in rows
                            )
                        )
                        await database.execute(MINIMAL_MARK, ([row_id for row_id, _ in rows],))
                if len(rows) < MINIMAL_BATCH:
                    break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=1.0)
        forwarding.result()

    async def consumer(self, url: str) -> None:
        """Deliveries into the inbox in bursts: one INSERT and one multiple-ack per burst.

        Flushes run one at a time and each takes everything delivered so far, so every
        delivery tag up to the burst's last one is in this burst or an earlier, committed
        one: the multiple-ack never acks an uncommitted delivery.
        """
        database = await psycopg.AsyncConnection.connect(url)
        connection = await aio_pika.connect(self.context.amqp_url, timeout=10)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=MINIMAL_PREFETCH)
        declared = await declare_topology(channel, self.topology())
        pending: list[aio_pika.abc.AbstractIncomingMessage] = []
        flushing: list[asyncio.Task[None]] = []

        async def flush() -> None:
            while pending:
                burst = pending[:]
                pending.clear()
                async with database.transaction():
                    await database.execute(INBOX_BATCH, ([UUID(m.body.decode()) for m in burst],))
                await burst[-1].ack(multiple=True)

        ready_marker()
        async with declared.queue.iterator() as deliveries:
            async for message in deliveries:
                pending.append(message)
                if not flushing or flushing[0].done():
                    if flushing:
                        flushing.pop().result()
                    flushing.append(asyncio.create_task(flush()))
