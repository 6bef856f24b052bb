"""Cost as the history grows: every hot statement and page on a database holding N
settled operations, against the same on an empty one (issue #48, item 1).

    .venv/bin/python -m bench.history_scale --operations N [--calls 200] [--batch 100000]
        [--database-url postgresql://postgres@127.0.0.1:5432/postgres] [--keep]

Two scratch databases on the server of ``--database-url`` (``outbox_bench_history_empty``
and ``outbox_bench_history_full``, dropped at the end unless ``--keep``): the schema, the
same small live workload in each (``bench/history_live.py``: decisions pending
publication, prepared, in flight, unknown and due, escalated), and in the full one N
settled operations written first by ``bench/history_fill.py`` (its docstring: the
proportions, and why the fill switches the tables' triggers off inside its own
transactions, as the owner). Both are VACUUM ANALYZEd, then each operation below is
called ``--calls`` times on each (after a few unmeasured calls), in ten rounds that
alternate between the two databases so that a shared machine's load weighs on both
alike, through the project's own code paths; the medians and p95s are compared:

- ``record_decision``: ``outbox.record_decision`` of one decision;
- the dispatcher's claim (``claim_outbox_batch`` and ``mark_outbox_published``) and its
  gauges (``outbox_backlog``, ``operations_by_state``);
- the consumer's claim (``claim_deliveries``) and outcome (``commit_many``), each after
  a ``get_operation`` of the operation it moves (what the call needs to be built);
- the reconciler's pass: each statement of ``Reconciler.requeue_stale`` and
  ``reconcile_once`` that reads the tables, and all of them in one row;
- the console's overview, escalations and operation pages, and the operations of a rare
  tool (``/operations?tool=T``, and with ``&state=committed``: three operations the
  history holds none of), over HTTP (Starlette's test client, behind a trusted proxy's
  identity header);
- ``outbox ops list``, ``outbox ops list --tool T`` of the rare tool and ``outbox ops
  verify OP`` (``run_command``, output discarded),
  and verifying the chains of one run's operations (``verify_chain`` for each, as the
  console lists the run);
- ``outbox.await_outcome`` of a settled decision, through one ``OutcomeWatcher``.

Whatever writes runs in a transaction that is rolled back, so every call finds the same
database; the commit's fsync, the same on both, is not in the figures. Prints a table,
writes ``bench/results/history_scale.json``, and an EXPLAIN of each read behind a row
whose median grew past ``--threshold`` (1.2).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.history_fill import fill
from bench.history_live import (
    DEFAULT_AMQP_URL,
    LiveWorkload,
    measurements,
    start_live_workload,
)
from bench.reporting import json_safe, percentile
from outbox.cli import positive_int
from outbox.sandbox.scratch import ScratchDatabase
from outbox.settings import libpq_url

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "history_scale.json"
WARMUP = 5
ROUNDS = 10
TABLES = (
    "operations",
    "operation_events",
    "operation_event_heads",
    "outbox",
    "approvals",
    "callbacks",
    "agent_reports",
)


def summary(taken: list[float]) -> dict[str, float]:
    ordered = sorted(taken)
    return {"median_ms": statistics.median(ordered), "p95_ms": percentile(ordered, 0.95)}


def timed(call: Callable[[], object], calls: int) -> list[float]:
    taken = []
    for _ in range(calls):
        began = time.perf_counter()
        call()
        taken.append((time.perf_counter() - began) * 1000)
    return taken


def measure_both(
    empty: tuple[str, LiveWorkload],
    full: tuple[str, LiveWorkload],
    calls: int,
    amqp_url: str = DEFAULT_AMQP_URL,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Every named operation on both databases, in rounds that alternate between them
    (a shared machine's load then weighs on both alike): name -> median and p95, ms."""
    figures: tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]] = ({}, {})
    with (
        measurements(*empty, amqp_url) as on_empty,
        measurements(*full, amqp_url) as on_full,
    ):
        for name in on_empty:
            taken: tuple[list[float], list[float]] = ([], [])
            for named in (on_empty, on_full):
                timed(named[name], min(WARMUP, calls))
            for round_ in range(ROUNDS):
                share = calls // ROUNDS + (1 if round_ < calls % ROUNDS else 0)
                for side, named in enumerate((on_empty, on_full)):
                    taken[side].extend(timed(named[name], share))
            for side in (0, 1):
                figures[side][name] = summary(taken[side])
    return figures


def analyze(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute("VACUUM ANALYZE")


def sizes(url: str) -> dict[str, Any]:
    """Bytes on disk of each filled table: heap (with TOAST) and indexes."""
    with psycopg.connect(url) as connection:
        rows = connection.execute(
            "SELECT c.relname, pg_table_size(c.oid), pg_indexes_size(c.oid) "
            "FROM pg_class c WHERE c.relname = ANY(%(tables)s) "
            "AND c.relnamespace = current_schema()::regnamespace",
            {"tables": list(TABLES)},
        ).fetchall()
        indexes = connection.execute(
            "SELECT i.indexrelid::regclass::text, pg_relation_size(i.indexrelid) "
            "FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
            "WHERE c.relname = ANY(%(tables)s) ORDER BY 2 DESC",
            {"tables": list(TABLES)},
        ).fetchall()
    return {
        "tables": {name: {"table_bytes": heap, "index_bytes": index} for name, heap, index in rows},
        "indexes": {name: size for name, size in indexes},
    }


def build(
    database: ScratchDatabase, operations: int, batch: int
) -> tuple[str, LiveWorkload, float | None]:
    url = database.recreate()
    fill_seconds = None
    if operations:
        began = time.monotonic()
        fill(
            url,
            operations,
            batch=batch,
            progress=lambda done, seconds: print(
                f"  filled {done:,} operations in {seconds:,.0f} s", flush=True
            ),
        )
        fill_seconds = time.monotonic() - began
    live = start_live_workload(url)
    analyze(url)
    return url, live, fill_seconds


def table(rows: list[dict[str, Any]]) -> str:
    width = max(len(row["operation"]) for row in rows)
    lines = [f"{'operation':<{width}}  {'empty ms':>9}  {'full ms':>9}  {'ratio':>6}  p95 e/f ms"]
    for row in rows:
        lines.append(
            f"{row['operation']:<{width}}  {row['empty']['median_ms']:>9.3f}  "
            f"{row['full']['median_ms']:>9.3f}  {row['ratio']:>6.2f}  "
            f"{row['empty']['p95_ms']:.3f}/{row['full']['p95_ms']:.3f}"
        )
    return "\n".join(lines)


def compare(
    empty: dict[str, dict[str, float]], full: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    return [
        {
            "operation": name,
            "empty": empty[name],
            "full": full[name],
            "ratio": full[name]["median_ms"] / empty[name]["median_ms"],
        }
        for name in empty
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--operations", type=positive_int, required=True)
    parser.add_argument("--calls", type=positive_int, default=200)
    parser.add_argument("--batch", type=positive_int, default=100_000)
    parser.add_argument("--threshold", type=float, default=1.2)
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument(
        "--amqp-url", default=DEFAULT_AMQP_URL, help="the broker the console's overview asks"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--keep", action="store_true", help="leave both databases in place")
    args = parser.parse_args()
    admin = libpq_url(args.database_url)
    empty_db = ScratchDatabase(admin, "outbox_bench_history_empty")
    full_db = ScratchDatabase(admin, "outbox_bench_history_full")
    try:
        print("empty database: schema and the live workload", flush=True)
        empty_url, empty_live, _ = build(empty_db, 0, args.batch)
        print(f"full database: {args.operations:,} settled operations", flush=True)
        full_url, full_live, fill_seconds = build(full_db, args.operations, args.batch)
        print(f"measuring, {args.calls} calls each on each database", flush=True)
        empty, full = measure_both((empty_url, empty_live), (full_url, full_live), args.calls)
        rows = compare(empty, full)
        grown = [row["operation"] for row in rows if row["ratio"] > args.threshold]
        plans = {name: full_live.explain(full_url, name) for name in grown}
        on_disk = sizes(full_url)
    finally:
        if not args.keep:
            empty_db.drop()
            full_db.drop()
    print(table(rows))
    for name, plan in plans.items():
        print(f"\n-- EXPLAIN (ANALYZE, BUFFERS) behind {name!r} on the full database:\n{plan}")
    total = sum(t["table_bytes"] + t["index_bytes"] for t in on_disk["tables"].values())
    print(f"\nfill: {args.operations:,} operations in {fill_seconds:.1f} s")
    print(f"on disk: {total:,} bytes, {total / args.operations:,.1f} bytes an operation")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            json_safe(
                {
                    "when": datetime.now(UTC).isoformat(),
                    "host": platform.node(),
                    "operations": args.operations,
                    "calls": args.calls,
                    "fill_seconds": fill_seconds,
                    "threshold": args.threshold,
                    "rows": rows,
                    "grown": grown,
                    "plans": plans,
                    "sizes": on_disk,
                    "bytes_per_operation": total / args.operations,
                }
            ),
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
