"""bench/dispatcher.py's latency phase: the daemon on this event loop while a writer
records decisions at a steady rate and a consumer notes when each arrives."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import psycopg
from aio_pika.abc import AbstractIncomingMessage

from bench.dispatcher_support import (
    CONSUMER_PREFETCH,
    TOOL,
    HistogramSnapshot,
    counter_total,
    ms,
    publish_state,
    purge,
    recreate_database,
    run_loop,
)
from bench.e2e_tools import refund_registry
from bench.latency import Lateness, achieved_rate, due_at, scheduled
from bench.reporting import percentile
from dispatcher.daemon import Dispatcher
from outbox import Registry, record_decision_async
from outbox.broker import Topology
from outbox.metrics import MetricNames
from outbox.sandbox.scratch import ScratchEnvironment


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
