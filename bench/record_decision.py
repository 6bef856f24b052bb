"""Throughput of record_decision: operation + outbox row + event, one commit each.

    .venv/bin/python bench/record_decision.py [--seconds 10] [--runs 3] [--connections 8]

Uses (and recreates) the database named by --database-url (default: outbox_bench on
localhost). Prints tx/s per run and the median, for sync threads and for asyncio tasks.
Compare with docs/design.md section 14 (raw SQL: ~2,700 tx/s for two INSERTs, ~7,900 for one
CTE, 8 connections): the gap is this library's validation, canonicalization and
fingerprinting in Python, on a 2-core machine where one core saturates first.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from outbox import Registry, record_decision, record_decision_async
from outbox.sandbox.scratch import ScratchDatabase
from outbox.settings import database_name, libpq_url, with_database

from support.sample_tools import build_registry


def recreate(url: str) -> None:
    ScratchDatabase(with_database(url, "postgres"), database_name(url)).recreate()


def sync_run(url: str, registry: Registry, seconds: float, connections: int) -> float:
    done = [0] * connections
    deadline = time.monotonic() + seconds
    start = threading.Barrier(connections + 1)

    def worker(index: int) -> None:
        with psycopg.connect(url) as connection:
            start.wait()
            n = 0
            while time.monotonic() < deadline:
                with connection.transaction():
                    record_decision(
                        connection,
                        registry,
                        "send_refund",
                        {"payment_id": f"pay_{index}_{n}", "amount_cents": 1250},
                        run_id=f"bench_{index}",
                        decision_key=f"k{n}",
                    )
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


async def async_run(url: str, registry: Registry, seconds: float, connections: int) -> float:
    deadline = time.monotonic() + seconds

    async def worker(index: int) -> int:
        n = 0
        async with await psycopg.AsyncConnection.connect(url) as connection:
            while time.monotonic() < deadline:
                async with connection.transaction():
                    await record_decision_async(
                        connection,
                        registry,
                        "send_refund",
                        {"payment_id": f"pay_{index}_{n}", "amount_cents": 1250},
                        run_id=f"abench_{index}",
                        decision_key=f"k{n}",
                    )
                n += 1
        return n

    began = time.monotonic()
    counts = await asyncio.gather(*(worker(i) for i in range(connections)))
    return sum(counts) / (time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", default="postgresql://localhost:5432/outbox_bench")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    url = libpq_url(args.database_url)
    registry = build_registry()
    for label, run in (
        ("sync threads", lambda: sync_run(url, registry, args.seconds, args.connections)),
        (
            "asyncio tasks",
            lambda: asyncio.run(async_run(url, registry, args.seconds, args.connections)),
        ),
    ):
        rates = []
        for _ in range(args.runs):
            recreate(url)
            rates.append(run())
        shown = ", ".join(f"{rate:,.0f}" for rate in rates)
        print(
            f"record_decision, {label}, {args.connections} connections, {args.seconds:g} s: "
            f"runs {shown} tx/s; median {statistics.median(rates):,.0f} tx/s"
        )


if __name__ == "__main__":
    main()
