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
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from bench.dispatcher_latency import latency_phase, writer_child
from bench.dispatcher_support import (
    CONSUMER_PREFETCH,
    EVENT_LOOP,
    INSERT_CHUNK,
    WARMUP_MESSAGES,
    insert_rows,
    make_settings,
    recreate_database,
    run_loop,
    server_version,
)
from bench.dispatcher_throughput import drain_phase, raw_again, raw_phase
from bench.e2e_tools import refund_registry
from bench.latency import Lateness, Pace
from bench.reporting import json_safe
from outbox import Settings
from outbox.cli import positive_int
from outbox.daemon import freeze_startup_heap
from outbox.sandbox.scratch import ScratchEnvironment
from outbox.settings import libpq_url

T = TypeVar("T")

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/outbox_bench_dispatcher"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "dispatcher.json"


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
