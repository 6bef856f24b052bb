"""Throughput of record_decision: operation + outbox row + event, one commit each.

    .venv/bin/python -m bench.record_decision [--seconds 10] [--runs 3] [--connections 8]
        [--modes bare,sync,async,own]

Uses (and recreates) the database named by --database-url (default: outbox_bench on
localhost). Prints tx/s per run and the median: for the bare statement record_decision
runs (``insert_decision`` of outbox/sql/queries.sql, its parameters built in advance, sync
threads), then for record_decision from sync threads and from asyncio tasks (``own``:
each decision a transaction of its own, ``own_transaction=True``), each with
its ratio to the bare statement's median when that was measured in the same invocation.
The bare figure is the ceiling on this machine at this moment; the ratio, not the
absolute figure, is what issue #14's target (docs/benchmarks.md) is about, since a
shared machine moves both together. Where each commit waits on a slow disk, both figures are the
disk's and the ratio is near 1 whatever the Python costs; to measure the client, add
``?options=-c%20synchronous_commit%3Doff`` to the --database-url.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.e2e_tools import refund_registry
from outbox import Registry, record_decision, record_decision_async
from outbox.bounds import DECISION_LOCK_TIMEOUT
from outbox.cli import positive_int
from outbox.sandbox.scratch import ScratchDatabase
from outbox.settings import database_name, libpq_url, with_database
from outbox.sql import QUERIES


def recreate(url: str) -> None:
    ScratchDatabase(with_database(url, "postgres"), database_name(url)).recreate()


def bare_params(index: int, n: int) -> dict[str, Any]:
    """What record_decision sends for the bench's decision, but built by the caller: the
    stored input as send_refund's model dumps it, and a fixed fingerprint."""
    return {
        "id": uuid.uuid4(),
        "run_id": f"bare_{index}",
        "decision_key": f"k{n}",
        "tool_name": "send_refund",
        "tool_version": 1,
        "side_effect": "deduplicated_write",
        "input": Jsonb(
            {
                "payment_id": f"pay_{index}_{n}",
                "amount_cents": 1250,
                "currency": "EUR",
                "reason": "",
            }
        ),
        "input_fingerprint": "0" * 64,
        "requires_approval": False,
        "headers": Jsonb({}),
        "lock_timeout_ms": round(DECISION_LOCK_TIMEOUT * 1000),
    }


def threaded_run(
    url: str,
    seconds: float,
    connections: int,
    decide: Callable[[psycopg.Connection[Any], int, int], object],
) -> float:
    """Transactions per second over ``connections`` sync threads, each with its own
    connection, each transaction one call of ``decide(connection, thread, n)``; timed
    from the moment every thread is connected."""
    done = [0] * connections
    deadline = time.monotonic() + seconds
    start = threading.Barrier(connections + 1)

    def worker(index: int) -> None:
        with psycopg.connect(url) as connection:
            start.wait()
            n = 0
            while time.monotonic() < deadline:
                with connection.transaction():
                    decide(connection, index, n)
                n += 1
            done[index] = n

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(connections)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.monotonic()
    for thread in threads:
        thread.join()
    return sum(done) / (time.monotonic() - began)


def bare_run(url: str, seconds: float, connections: int) -> float:
    """The statement alone, from sync threads: one execute and one commit per decision."""
    sql = QUERIES["insert_decision"].sql
    return threaded_run(
        url,
        seconds,
        connections,
        lambda connection, index, n: connection.execute(sql, bare_params(index, n)).fetchall(),
    )


def sync_run(url: str, registry: Registry, seconds: float, connections: int) -> float:
    return threaded_run(
        url,
        seconds,
        connections,
        lambda connection, index, n: record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": f"pay_{index}_{n}", "amount_cents": 1250},
            run_id=f"bench_{index}",
            decision_key=f"k{n}",
        ),
    )


async def async_run(
    url: str, registry: Registry, seconds: float, connections: int, *, own: bool = False
) -> float:
    """``own``: each decision a transaction of its own on an autocommit connection
    (``own_transaction=True``, one round trip), else in a transaction block."""
    deadline = time.monotonic() + seconds

    async def decide(connection: psycopg.AsyncConnection[Any], index: int, n: int) -> None:
        await record_decision_async(
            connection,
            registry,
            "send_refund",
            {"payment_id": f"pay_{index}_{n}", "amount_cents": 1250},
            run_id=f"abench_{index}",
            decision_key=f"k{n}",
            own_transaction=own,
        )

    async def worker(index: int) -> int:
        n = 0
        async with await psycopg.AsyncConnection.connect(url, autocommit=own) as connection:
            while time.monotonic() < deadline:
                if own:
                    await decide(connection, index, n)
                else:
                    async with connection.transaction():
                        await decide(connection, index, n)
                n += 1
        return n

    began = time.monotonic()
    counts = await asyncio.gather(*(worker(i) for i in range(connections)))
    return sum(counts) / (time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", default="postgresql://localhost:5432/outbox_bench")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=positive_int, default=3)
    parser.add_argument("--connections", type=positive_int, default=8)
    parser.add_argument(
        "--modes",
        default="bare,sync,async",
        help="comma-separated, in order: bare (the statement alone), sync, async, own "
        "(async, each decision its own transaction in autocommit)",
    )
    args = parser.parse_args()
    url = libpq_url(args.database_url)
    registry = refund_registry()
    modes: dict[str, tuple[str, Callable[[], float]]] = {
        "bare": (
            "bare statement, sync threads",
            lambda: bare_run(url, args.seconds, args.connections),
        ),
        "sync": (
            "record_decision, sync threads",
            lambda: sync_run(url, registry, args.seconds, args.connections),
        ),
        "async": (
            "record_decision, asyncio tasks",
            lambda: asyncio.run(async_run(url, registry, args.seconds, args.connections)),
        ),
        "own": (
            "record_decision, asyncio tasks, own_transaction",
            lambda: asyncio.run(async_run(url, registry, args.seconds, args.connections, own=True)),
        ),
    }
    wanted = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = [mode for mode in wanted if mode not in modes]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(modes)}")
    bare_median: float | None = None
    for mode in wanted:
        label, run = modes[mode]
        rates = []
        for _ in range(args.runs):
            recreate(url)
            rates.append(run())
        median = statistics.median(rates)
        if mode == "bare":
            bare_median = median
        shown = ", ".join(f"{rate:,.0f}" for rate in rates)
        ratio = (
            f" ({median / bare_median:.2f}x the bare statement)"
            if mode != "bare" and bare_median
            else ""
        )
        print(
            f"{label}, {args.connections} connections, {args.seconds:g} s: "
            f"runs {shown} tx/s; median {median:,.0f} tx/s{ratio}"
        )


if __name__ == "__main__":
    main()
