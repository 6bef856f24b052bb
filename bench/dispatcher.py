"""Dispatcher throughput and latency against the raw aio-pika limit, in one run.

    .venv/bin/python -m bench.dispatcher [--json bench/results/dispatcher.json]
        [--messages 20000] [--serial-messages 2000] [--seconds 20] [--rate 500]

All on the same Postgres and RabbitMQ, in this order:

1. raw limit: aio-pika alone, no database. ``--messages`` messages shaped exactly like
   the dispatcher's (``encode`` on synthetic rows, as aio-pika Messages: persistent,
   mandatory) to a
   quorum queue with the dispatcher's topology, on a confirm channel with
   ``on_return_raises``; confirms pipelined in windows of the batch size. For reference:
   awaiting each confirm one at a time (``--serial-messages``), and the dispatcher's
   ``Publisher.publish`` on the same synthetic rows (encode and outcome
   bookkeeping included, still no database).
2. dispatcher drain: ``--messages`` rows recorded through ``record_decision`` in
   transactions of 500 (not timed), then ``Dispatcher(settings).drain()`` (what
   ``outbox dispatcher --once`` runs) timed from start to return, then checked: every row
   has ``published_at`` and the queue holds every message.
3. latency: the daemon on this event loop while one writer records a decision per
   transaction at ``--rate`` per second for ``--seconds`` (``record_decision_async``, a
   monotonic schedule) and a consumer (own connection, prefetch 500) notes when each
   operation id arrives. Commit-to-delivery percentiles (an upper bound of
   commit-to-confirm) and the dispatcher's own ``commit_to_confirm`` histogram. Once with
   LISTEN/NOTIFY, once polling only (the notify trigger disabled). The writer runs in a
   child process by default, as an agent would; ``--writer inline`` puts it on the
   dispatcher's event loop instead, where its CPU delays the batches.
4. a table on stdout; every figure, plus the environment, in JSON.

Uses (and recreates) its own database (``--database-url``, default
``outbox_bench_dispatcher``) and its own exchanges and queues (``bench.dispatcher.*``);
drops and deletes them at the end. Exits 1 when a check failed. The figures to compare
with are in docs/benchmarks.md and docs/design.md section 14.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import aio_pika
import psycopg
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from bench.e2e_tools import REFUND_TOOL, refund_registry
from bench.latency import Lateness, Pace, achieved_rate, due_at, scheduled
from bench.reporting import json_safe, percentile
from dispatcher.daemon import Dispatcher
from dispatcher.publisher import Publisher, encode
from outbox import Registry, Settings, record_decision, record_decision_async
from outbox.broker import Topology, declare_topology
from outbox.cli import positive_int, run_async
from outbox.daemon import freeze_startup_heap
from outbox.metrics import MetricNames
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.settings import libpq_url, with_database
from outbox.store import ClaimedRow

T = TypeVar("T")

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/outbox_bench_dispatcher"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "dispatcher.json"
NAME_PREFIX = "bench.dispatcher"
TOOL = REFUND_TOOL
ROUTING_KEY = "send_refund.v1"  # what insert_decision writes: tool_name || '.v' || version
INSERT_CHUNK = 500
CONSUMER_PREFETCH = 500
WARMUP_MESSAGES = 1_000  # published (and purged) on the raw channel before timing
DRAIN_CONNECT_ATTEMPTS = 5  # as dispatcher.cli does for --once


# --- setup ---------------------------------------------------------------------------


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


# --- statistics ----------------------------------------------------------------------


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


# --- 1. raw limit --------------------------------------------------------------------


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


# --- 2. dispatcher drain -------------------------------------------------------------


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


# --- 3. latency ----------------------------------------------------------------------


@dataclass
class Deliveries:
    received: dict[str, float] = field(default_factory=dict)
    duplicates: int = 0

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        now = time.monotonic()
        operation_id = str(json.loads(message.body)["operation_id"])
        if operation_id in self.received:
            self.duplicates += 1
        else:
            self.received[operation_id] = now
        await message.ack()


async def wait_until_ready(dispatcher: Dispatcher, task: asyncio.Task[None]) -> None:
    deadline = time.monotonic() + 20
    while not dispatcher.healthy():
        if task.done():
            task.result()
            raise RuntimeError("the dispatcher stopped before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError("the dispatcher session was not ready within 20 s")
        await asyncio.sleep(0.05)


async def write_at_rate(
    url: str, registry: Registry, rate: float, seconds: float, run_id: str
) -> tuple[dict[str, float], float, dict[str, Any]]:
    """One decision per transaction on a monotonic schedule.

    Returns ({operation id: commit time}, achieved decisions/s, lateness stats)."""
    commits: dict[str, float] = {}
    lateness = Lateness()
    async with await psycopg.AsyncConnection.connect(url) as connection:
        began = time.monotonic()
        for n in scheduled(rate, seconds):
            due = due_at(began, rate, n)
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
                now = time.monotonic()
            lateness.record(due, now)
            async with connection.transaction():
                recorded = await record_decision_async(
                    connection,
                    registry,
                    TOOL,
                    {"payment_id": f"pay_{n}", "amount_cents": 1250},
                    run_id=run_id,
                    decision_key=f"k{n}",
                )
            commits[str(recorded.operation.id)] = time.monotonic()
        achieved = achieved_rate(len(commits), began, time.monotonic())
    return commits, achieved, lateness.as_dict()


async def write_in_child(
    url: str, rate: float, seconds: float, run_id: str
) -> tuple[dict[str, float], float, dict[str, Any]]:
    """write_at_rate in a child interpreter (this module, --writer-child), so the writer's
    CPU does not queue on the dispatcher's event loop. CLOCK_MONOTONIC is system-wide,
    so its commit times compare with this process's receipt times."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.dispatcher",
        "--writer-child",
        "--database-url",
        url,
        "--rate",
        repr(rate),
        "--seconds",
        repr(seconds),
        "--run-id",
        run_id,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the writer process failed with exit code {process.returncode}")
    written = json.loads(out)
    return written["commits"], written["achieved_per_s"], written["lateness"]


def writer_child(args: argparse.Namespace) -> None:
    commits, achieved, lateness = run_loop(
        write_at_rate(args.database_url, refund_registry(), args.rate, args.seconds, args.run_id)
    )
    json.dump({"commits": commits, "achieved_per_s": achieved, "lateness": lateness}, sys.stdout)


async def latency_phase(
    scratch: ScratchEnvironment,
    registry: Registry,
    rate: float,
    seconds: float,
    *,
    notify: bool,
    writer: str,
) -> dict[str, Any]:
    label = "notify" if notify else "polling"
    settings = scratch.settings
    topology = Topology.from_settings(settings)
    amqp_url = settings.amqp_url.get_secret_value()
    await asyncio.to_thread(recreate_database, scratch, notify=notify)
    await purge(amqp_url, topology)
    deliveries = Deliveries()
    failures: list[str] = []

    consumer = await aio_pika.connect(amqp_url, timeout=10)
    async with consumer:
        channel = await consumer.channel()
        await channel.set_qos(prefetch_count=CONSUMER_PREFETCH)
        queue = await channel.declare_queue(topology.queue, passive=True)
        consumer_tag = await queue.consume(deliveries.on_message)

        dispatcher = Dispatcher(settings)
        task = asyncio.create_task(dispatcher.run())
        try:
            await wait_until_ready(dispatcher, task)
            run_id = f"bench_latency_{label}"
            if writer == "process":
                commits, achieved, lateness = await write_in_child(
                    settings.libpq_url, rate, seconds, run_id
                )
            else:
                commits, achieved, lateness = await write_at_rate(
                    settings.libpq_url, registry, rate, seconds, run_id
                )
            deadline = time.monotonic() + 10 + 3 * settings.poll_interval
            while not commits.keys() <= deliveries.received.keys():
                if time.monotonic() > deadline or task.done():
                    break
                await asyncio.sleep(0.05)
        finally:
            dispatcher.stop()
            await asyncio.wait_for(task, timeout=30)
        await queue.cancel(consumer_tag)

    missing = len(commits.keys() - deliveries.received.keys())
    if missing:
        failures.append(f"latency {label}: {missing} of {len(commits)} decisions never delivered")
    if deliveries.duplicates:
        failures.append(f"latency {label}: {deliveries.duplicates} duplicate deliveries")
    rows, published = await asyncio.to_thread(publish_state, settings.libpq_url)
    if (rows, published) != (len(commits), len(commits)):
        failures.append(f"latency {label}: {published} of {rows} outbox rows published")

    reconnects = counter_total(dispatcher.metrics.registry, MetricNames.DISPATCHER_RECONNECTS)
    if reconnects:
        failures.append(f"latency {label}: the dispatcher reconnected {reconnects} times")
    latencies = sorted(
        deliveries.received[op] - committed
        for op, committed in commits.items()
        if op in deliveries.received
    )
    histogram = HistogramSnapshot.collect(
        dispatcher.metrics.registry, MetricNames.DISPATCHER_COMMIT_TO_CONFIRM
    )
    batches = HistogramSnapshot.collect(
        dispatcher.metrics.registry, MetricNames.DISPATCHER_BATCH_SIZE
    )
    await purge(amqp_url, topology)
    return {
        "mode": "LISTEN/NOTIFY" if notify else f"polling {settings.poll_interval:g} s",
        "writer": writer,
        "offered_per_s": rate,
        "seconds": seconds,
        "decisions": len(commits),
        "achieved_per_s": achieved,
        "writer_lateness": lateness,
        "delivered": len(latencies),
        "duplicates": deliveries.duplicates,
        "commit_to_delivery_ms": {
            "p50": ms(percentile(latencies, 0.50)),
            "p90": ms(percentile(latencies, 0.90)),
            "p99": ms(percentile(latencies, 0.99)),
            "max": ms(latencies[-1]) if latencies else math.nan,
            "mean": ms(sum(latencies) / len(latencies)) if latencies else math.nan,
        },
        "dispatcher_commit_to_confirm_ms": {
            "p50": ms(histogram.quantile(0.50)),
            "p99": ms(histogram.quantile(0.99)),
            "p99_bucket_ms": [ms(bound) for bound in histogram.bucket_of(0.99)],
            "mean": ms(histogram.mean),
            "count": int(histogram.count),
            "buckets": {f"{upper:g}": int(count) for upper, count in histogram.buckets},
        },
        "batches": int(batches.count),
        "mean_batch_size": round(batches.mean, 2),
        "failures": failures,
    }


# --- report --------------------------------------------------------------------------


def environment(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "event_loop": EVENT_LOOP[0],
        "aio_pika": metadata.version("aio-pika"),
        "aiormq": metadata.version("aiormq"),
        "psycopg": metadata.version("psycopg"),
        "libpq": psycopg.pq.version(),
        "postgres_server": server_version(settings.libpq_url),
        "batch_size": settings.batch_size,
        "poll_interval_s": settings.poll_interval,
        "publish_timeout_s": settings.publish_timeout,
        "messages": args.messages,
        "serial_messages": args.serial_messages,
        "latency_rate_per_s": args.rate,
        "latency_seconds": args.seconds,
        "latency_writer": args.writer,
        "raw_warmup_messages": WARMUP_MESSAGES,
        "insert_chunk": INSERT_CHUNK,
        "consumer_prefetch": CONSUMER_PREFETCH,
    }


def latency_line(result: dict[str, Any]) -> str:
    figures = result["commit_to_delivery_ms"]
    return (
        f"p50 {figures['p50']:,.1f} ms  p99 {figures['p99']:,.1f} ms  "
        f"max {figures['max']:,.1f} ms  (commit->delivery)"
    )


def histogram_line(result: dict[str, Any]) -> str:
    figures = result["dispatcher_commit_to_confirm_ms"]
    lower, upper = figures["p99_bucket_ms"]
    return (
        f"p50 ~{figures['p50']:,.1f} ms  p99 ~{figures['p99']:,.1f} ms  "
        f"(interpolated; p99 bucket {lower:,g}-{upper:,g} ms)"
    )


def table(results: dict[str, Any]) -> str:
    raw, drain = results.get("raw"), results.get("drain")
    batch = results["environment"]["batch_size"]
    lines: list[tuple[str, str]] = []
    if raw is not None:
        lines += [
            (
                f"raw aio-pika, {batch} confirms in flight",
                f"{raw['pipelined_per_s']:,.0f} msg/s"
                + (
                    f"  (again after the drain: {raw['pipelined_after_drain_per_s']:,.0f})"
                    if "pipelined_after_drain_per_s" in raw
                    else ""
                ),
            ),
            ("raw aio-pika, one confirm at a time", f"{raw['serial_per_s']:,.0f} msg/s"),
            (
                "Publisher.publish, no database",
                f"{raw['publisher_per_s']:,.0f} msg/s  "
                f"({raw['publisher_per_s'] / raw['pipelined_per_s']:.2f}x raw)",
            ),
            ("encode alone (+ aio_pika.Message)", f"{raw['build_message_per_s']:,.0f} msg/s"),
        ]
    if drain is not None:
        ratio = (
            f"  ({drain['ratio_to_raw']:.2f}x raw, before and after averaged)"
            if "ratio_to_raw" in drain
            else ""
        )
        lines.append(("dispatcher drain (--once)", f"{drain['per_s']:,.0f} msg/s{ratio}"))
    for result in results["latency"].values():
        pace = Pace(
            result["offered_per_s"],
            result["achieved_per_s"],
            Lateness.from_dict(result["writer_lateness"]),
        )
        lines += [
            (f"latency {result['mode']} {pace.label()}", latency_line(result)),
            ("  dispatcher commit_to_confirm", histogram_line(result)),
            (
                "  writer",
                f"{pace.describe()}  ({result['delivered']:,} delivered, "
                f"mean batch {result['mean_batch_size']:g}, writer: {result['writer']})",
            ),
        ]
    if not lines:
        return "(no figures)"
    width = max(len(what) for what, _ in lines) + 3
    out = [f"{'what':<{width}}figure"]
    out += [f"{what:<{width}}{figure}" for what, figure in lines]
    return "\n".join(out)


def run_phase(name: str, failures: list[str], phase: Callable[[], T]) -> T | None:
    """Run one phase; a phase that dies (say, the broker restarted) is a failure, and
    the phases after it still run."""
    try:
        return phase()
    except Exception as error:  # reported, and the run exits 1
        failures.append(f"{name}: aborted by {type(error).__name__}: {error}")
        print(f"FAILED: {failures[-1]}")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--amqp-url", default=DEFAULT_AMQP_URL)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument(
        "--messages", type=positive_int, default=20_000, help="raw and drain messages"
    )
    parser.add_argument("--serial-messages", type=positive_int, default=2_000)
    parser.add_argument("--batch-size", type=positive_int, default=200)
    parser.add_argument("--rate", type=float, default=500.0, help="latency: decisions/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="latency: seconds per mode")
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument(
        "--writer",
        choices=("process", "inline"),
        default="process",
        help="latency: write decisions from a child process (default) or on the "
        "dispatcher's own event loop",
    )
    parser.add_argument(
        "--loop",
        choices=["uvloop", "asyncio"],
        default="uvloop",
        help="event loop for every phase (outbox dispatcher runs on uvloop)",
    )
    parser.add_argument("--writer-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", default="bench_latency", help=argparse.SUPPRESS)
    args = parser.parse_args()
    EVENT_LOOP[0] = args.loop
    if args.writer_child:
        writer_child(args)
        return
    args.database_url = libpq_url(args.database_url)
    # Every phase in a process set up as `outbox dispatcher` sets itself up before it
    # dispatches (dispatcher/cli.py): the raw limit and the drain alike.
    freeze_startup_heap()
    settings = make_settings(args)
    # Its database and broker names are the bench's own: removed at the end, whatever
    # happened. The phases declare the topology (and recreate the database) themselves.
    scratch = ScratchEnvironment(settings, declare_topology=False)
    registry = refund_registry()
    results: dict[str, Any] = {"environment": environment(args, settings), "latency": {}}
    failures: list[str] = []
    began = time.monotonic()

    def drain() -> dict[str, Any]:
        recreate_database(scratch)
        insert_seconds = insert_rows(settings.libpq_url, registry, args.messages, "bench_drain")
        print(f"2/4 drain: {args.messages:,} rows recorded in {insert_seconds:.1f} s (not timed)")
        drained = run_loop(drain_phase(settings, args.messages))
        drained["insert_seconds"] = insert_seconds
        return drained

    def measure(notify: bool) -> dict[str, Any]:
        return run_loop(
            latency_phase(
                scratch, registry, args.rate, args.seconds, notify=notify, writer=args.writer
            )
        )

    try:
        print(f"1/4 raw aio-pika: {args.messages:,} pipelined, {args.serial_messages:,} serial")
        raw = run_phase(
            "raw",
            failures,
            lambda: run_loop(raw_phase(settings, args.messages, args.serial_messages)),
        )
        if raw is not None:
            results["environment"]["rabbitmq_server"] = raw.pop("rabbitmq_server", "?")
            results["raw"] = raw
            if raw["publisher_failed"]:
                failures.append(f"Publisher.publish: {raw['publisher_failed']} publishes failed")
        drained = run_phase("drain", failures, drain)
        if drained is not None:
            if raw is not None:
                after = run_phase(
                    "raw again",
                    failures,
                    lambda: run_loop(raw_again(settings, args.messages)),
                )
                limit = raw["pipelined_per_s"]
                if after is not None:
                    raw["pipelined_after_drain_per_s"] = after
                    limit = (limit + after) / 2
                drained["raw_limit_per_s"] = limit
                drained["ratio_to_raw"] = drained["per_s"] / limit
            results["drain"] = drained
            failures += drained["failures"]
        for notify in (True, False):
            key = "notify" if notify else "polling"
            print(f"3/4 latency, {key}: {args.rate:g} decisions/s for {args.seconds:g} s")
            latency = run_phase(f"latency {key}", failures, functools.partial(measure, notify))
            if latency is not None:
                results["latency"][key] = latency
                failures += latency["failures"]
    finally:
        for problem in scratch.remove():
            print(f"({problem})")

    results["failures"] = failures
    results["total_seconds"] = time.monotonic() - began
    print("4/4 results\n")
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(json_safe(results), indent=2, allow_nan=False) + "\n")
    print(f"\nwritten to {args.json} ({results['total_seconds']:.0f} s in all)")
    for failure in failures:
        print(f"FAILED: {failure}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
