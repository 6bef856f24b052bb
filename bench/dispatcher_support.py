"""What bench/dispatcher.py's phases share: the event loop, the settings and names, the
database and queues each phase starts from, and the statistics read from the
dispatcher's own metrics."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aio_pika
import psycopg
from aio_pika.abc import AbstractChannel
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from bench.e2e_tools import REFUND_TOOL
from outbox import Registry, Settings, record_decision
from outbox.broker import Topology, declare_topology
from outbox.cli import run_async
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.settings import with_database

T = TypeVar("T")

NAME_PREFIX = "bench.dispatcher"
TOOL = REFUND_TOOL
ROUTING_KEY = "send_refund.v1"  # what insert_decision writes: tool_name || '.v' || version
INSERT_CHUNK = 500
CONSUMER_PREFETCH = 500
WARMUP_MESSAGES = 1_000  # published (and purged) on the raw channel before timing
DRAIN_CONNECT_ATTEMPTS = 5  # as dispatcher.cli does for --once


# The loop every phase runs on; uvloop by default, as `outbox dispatcher` runs.
EVENT_LOOP = ["uvloop"]


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    if EVENT_LOOP[0] == "uvloop":
        return run_async(main)
    return asyncio.run(main)


def make_settings(args: argparse.Namespace) -> Settings:
    return Settings(
        database_url=SecretStr(args.database_url),
        amqp_url=SecretStr(args.amqp_url),
        exchange=f"{NAME_PREFIX}.outbox",
        queue=f"{NAME_PREFIX}.operations",
        dead_letter_exchange=f"{NAME_PREFIX}.dead",
        dead_letter_queue=f"{NAME_PREFIX}.operations.dead",
        batch_size=args.batch_size,
        poll_interval=args.poll_interval,
        metrics_host="127.0.0.1",
        metrics_port=0,
        # The bench's names are its own and every phase may be the first to use them.
        declare_topology=True,
    )


def recreate_database(scratch: ScratchEnvironment, *, notify: bool = True) -> None:
    url = scratch.database.recreate()
    if not notify:
        with psycopg.connect(url) as connection:
            connection.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_notify_pending")


def server_version(url: str) -> str:
    with psycopg.connect(with_database(url, "postgres"), autocommit=True) as connection:
        row = connection.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"


def publish_state(url: str) -> tuple[int, int]:
    """(outbox rows, rows with published_at), as committed."""
    with psycopg.connect(url, autocommit=True) as connection:
        row = connection.execute("SELECT count(*), count(published_at) FROM outbox").fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


def insert_rows(url: str, registry: Registry, count: int, run_id: str) -> float:
    """Record ``count`` decisions through record_decision, INSERT_CHUNK per transaction."""
    started = time.perf_counter()
    with psycopg.connect(url) as connection:
        for start in range(0, count, INSERT_CHUNK):
            with connection.transaction():
                for n in range(start, min(count, start + INSERT_CHUNK)):
                    record_decision(
                        connection,
                        registry,
                        TOOL,
                        {"payment_id": f"pay_{n}", "amount_cents": 1250},
                        run_id=run_id,
                        decision_key=f"k{n}",
                    )
    return time.perf_counter() - started


@contextlib.asynccontextmanager
async def broker_channel(amqp_url: str) -> AsyncIterator[AbstractChannel]:
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        yield await connection.channel()


async def queue_depth(amqp_url: str, queue: str) -> int:
    async with broker_channel(amqp_url) as channel:
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result.message_count or 0


async def purge(amqp_url: str, topology: Topology) -> None:
    async with broker_channel(amqp_url) as channel:
        await declare_topology(channel, topology)
        for name in (topology.queue, topology.dead_letter_queue):
            queue = await channel.declare_queue(name, passive=True)
            await queue.purge()


@dataclass
class HistogramSnapshot:
    buckets: list[tuple[float, float]] = field(default_factory=list)
    """(upper bound, cumulative count), ascending, +Inf last."""
    count: float = 0.0
    total: float = 0.0

    @classmethod
    def collect(cls, registry: CollectorRegistry, name: str) -> HistogramSnapshot:
        snapshot = cls()
        for family in registry.collect():
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name == f"{name}_bucket":
                    snapshot.buckets.append((float(sample.labels["le"]), sample.value))
                elif sample.name == f"{name}_count":
                    snapshot.count = sample.value
                elif sample.name == f"{name}_sum":
                    snapshot.total = sample.value
        snapshot.buckets.sort()
        return snapshot

    def quantile(self, q: float) -> float:
        """Linear interpolation within the bucket, as Prometheus' histogram_quantile."""
        if self.count == 0:
            return math.nan
        rank = q * self.count
        lower, below = 0.0, 0.0
        for upper, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower
                if cumulative == below:
                    return upper
                return lower + (upper - lower) * (rank - below) / (cumulative - below)
            lower, below = upper, cumulative
        return lower

    def bucket_of(self, q: float) -> tuple[float, float]:
        """(lower, upper] bounds of the bucket the q-quantile falls in."""
        rank = q * self.count
        lower = 0.0
        for upper, cumulative in self.buckets:
            if cumulative >= rank:
                return lower, upper
            lower = upper
        return lower, math.inf

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan


def counter_total(registry: CollectorRegistry, name: str) -> int:
    """A counter's value summed over its labels."""
    return int(
        sum(
            sample.value
            for family in registry.collect()
            if family.name == name
            for sample in family.samples
            if sample.name == f"{name}_total"
        )
    )


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
