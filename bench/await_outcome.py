"""How soon an awaiting agent hears that its decision settled: commit to waiter woken.

    .venv/bin/python -m bench.await_outcome [--waiters 1000] [--rate 500] [--seconds 10]
        [--modes notify poll] [--poll-interval 1.0]

One process holds ``--waiters`` concurrent ``OutcomeWatcher.wait`` calls on one watcher
(one connection), as an agent service with that many tool calls in flight would: a
sliding window over the recorded decisions, a new wait starting as one ends. Another
process settles the decisions in order at ``--rate``/s, one transaction each (claim,
then commit, as a consumer does), and notes the wall clock just after each settling
commit returned. Latency = the waiter's wall clock when its wait returned - that
commit time (same host, same clock).

Modes:
- ``notify``: the schema as shipped; the settling commit's event notifies the watcher.
- ``poll``: that trigger disabled; the watcher's poll (``--poll-interval``) alone.

Each mode gets a fresh database (``outbox_bench_await_<run>``, dropped at the end) on
the server of ``--database-url`` (env ``OUTBOX_BENCH_DATABASE_URL``). Prints a table;
everything in ``bench/results/await_outcome.json``. Exits 1 if a waiter missed its
settlement (a wait that returned pending).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import psycopg

from bench.e2e_tools import TOOL, build_registry
from bench.reporting import json_safe, percentile
from outbox import OutcomeStatus, OutcomeWatcher, record_decision, store
from outbox.cli import positive_int
from outbox.sandbox.scratch import ScratchDatabase
from outbox.settings import libpq_url
from outbox.store import Store

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "await_outcome.json"
LEASE = timedelta(minutes=10)


def recreate(database: ScratchDatabase, *, notify: bool) -> str:
    url = database.recreate()
    if not notify:
        with psycopg.connect(url) as connection:
            connection.execute(
                "ALTER TABLE operation_events DISABLE TRIGGER operation_events_notify_changed"
            )
    return url


def record_all(url: str, count: int) -> list[UUID]:
    registry = build_registry()
    ids: list[UUID] = []
    with psycopg.connect(url) as connection:
        for index in range(count):
            recorded = record_decision(
                connection, registry, TOOL, {"n": index}, run_id="bench", decision_key=str(index)
            )
            ids.append(recorded.operation.id)
    return ids


def settle_at_rate(url: str, ids: list[UUID], rate: float, start_at: float, results: Any) -> None:
    """Child process: one claim+commit transaction per decision, on a fixed schedule."""
    committed_at: dict[str, float] = {}
    with psycopg.connect(url) as connection:
        runner = Store(connection)
        for index, operation_id in enumerate(ids):
            due = start_at + index / rate
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)  # the schedule of a steady producer, not a wait for a condition
            claimed = runner.run(store.claim_many([(operation_id, LEASE)], owner="bench"))
            connection.commit()
            operation = claimed[operation_id]
            runner.run(
                store.commit_many(
                    [
                        store.ConfirmedEffect(
                            operation=operation,
                            provider_reference=f"re_{index}",
                            result={},
                            attributes={},
                        )
                    ]
                )
            )
            connection.commit()
            committed_at[str(operation_id)] = time.time()
    results.put(committed_at)


async def wait_all(
    url: str, ids: list[UUID], waiters: int, poll_interval: float
) -> tuple[dict[str, float], dict[str, Any]]:
    woken_at: dict[str, float] = {}
    missed: list[str] = []
    async with OutcomeWatcher(url, poll_interval=poll_interval) as watcher:
        queue = iter(ids)
        semaphore = asyncio.Semaphore(waiters)

        async def wait_one(operation_id: UUID) -> None:
            try:
                outcome = await watcher.wait(operation_id, timeout=120, until="final")
                woken_at[str(operation_id)] = time.time()
                if outcome.status is not OutcomeStatus.COMMITTED:
                    missed.append(str(operation_id))
            finally:
                semaphore.release()

        tasks = []
        for operation_id in queue:
            await semaphore.acquire()
            tasks.append(asyncio.create_task(wait_one(operation_id)))
        await asyncio.gather(*tasks)
        stats = {
            "reads": watcher.reads,
            "notifications": watcher.notifications,
            "listening": watcher.listening,
            "missed": len(missed),
        }
    return woken_at, stats


def run_mode(args: argparse.Namespace, run_name: str, mode: str) -> dict[str, Any]:
    database = ScratchDatabase(args.database_url, f"outbox_bench_await_{run_name}_{mode}")
    count = int(args.rate * args.seconds)
    url = recreate(database, notify=mode == "notify")
    try:
        ids = record_all(url, count)
        results: Any = multiprocessing.get_context("spawn").Queue()
        start_at = time.time() + 2.0  # the waiters are in place before the first settlement
        settler = multiprocessing.get_context("spawn").Process(
            target=settle_at_rate, args=(url, ids, args.rate, start_at, results)
        )
        settler.start()
        began = time.monotonic()
        woken_at, stats = asyncio.run(wait_all(url, ids, args.waiters, args.poll_interval))
        elapsed = time.monotonic() - began
        committed_at: dict[str, float] = results.get(timeout=60)
        settler.join(timeout=60)
    finally:
        database.drop()
    latencies = sorted(
        (woken_at[key] - committed_at[key]) * 1000 for key in committed_at if key in woken_at
    )
    return {
        "mode": mode,
        "decisions": count,
        "waiters": args.waiters,
        "poll_interval_s": args.poll_interval,
        "commit_to_woken_ms": {
            "p50": round(percentile(latencies, 0.50), 2),
            "p90": round(percentile(latencies, 0.90), 2),
            "p99": round(percentile(latencies, 0.99), 2),
            "max": round(latencies[-1], 2) if latencies else None,
            "mean": round(statistics.fmean(latencies), 2) if latencies else None,
        },
        "reads": stats["reads"],
        "reads_per_settlement": round(stats["reads"] / count, 3),
        "notifications": stats["notifications"],
        "missed": stats["missed"] + (count - len(latencies)),
        "elapsed_s": round(elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "OUTBOX_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    parser.add_argument("--waiters", type=positive_int, default=1000)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument(
        "--modes", nargs="+", choices=("notify", "poll"), default=["notify", "poll"]
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    args.database_url = libpq_url(args.database_url)
    run_name = uuid4().hex[:8]
    measured = []
    for mode in args.modes:
        print(f"{mode}: {args.waiters} waiters, {args.rate:g}/s for {args.seconds:g} s", flush=True)
        figures = run_mode(args, run_name, mode)
        measured.append(figures)
        latency = figures["commit_to_woken_ms"]
        print(
            f"  commit -> woken p50 {latency['p50']} ms, p99 {latency['p99']} ms, "
            f"max {latency['max']} ms; {figures['reads']} reads "
            f"({figures['reads_per_settlement']} per settlement), missed {figures['missed']}",
            flush=True,
        )
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "modes": measured,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(json_safe(report), indent=2) + "\n")
    sys.exit(1 if any(figures["missed"] for figures in measured) else 0)


if __name__ == "__main__":
    main()
