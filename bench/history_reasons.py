"""Why a row of ``bench.history_scale`` costs more on the full database: each statement
behind it under EXPLAIN (ANALYZE, BUFFERS) on both databases, its first call and then
warm, and the depth of every B-tree its plans read.

    .venv/bin/python -m bench.history_scale --operations N --keep   # leaves both databases
    .venv/bin/python -m bench.history_reasons [--warm 30] [--row NAME ...]
        [--database-url postgresql://postgres@127.0.0.1:5432/postgres]

Reads the two databases ``bench.history_scale --keep`` left (``outbox_bench_history_empty``
and ``_full``; ``CREATE EXTENSION IF NOT EXISTS pageinspect`` in each, for
``bt_metap``). For each row (by default every row whose statements
``LiveWorkload.statements`` names) and each of its statements, on each database: the
first call's planning and execution time and the pages it found in shared buffers and
read from outside them (shared hit and read, over the whole plan), then ``--warm`` calls
alternating between the databases, each in a transaction rolled back, and their median
planning and execution times and the last call's pages; then each index the plans read
with its B-tree level (``bt_metap``: 0 is a root that is a leaf; each level is one more
page per probe) and size on each database. ``shared_buffers`` decides what "read" means:
a page from the operating system's cache or the disk, not from Postgres's own.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import psycopg

from bench.history_live import LiveWorkload, measurements, read_live_workload
from outbox.cli import positive_int
from outbox.settings import with_database
from outbox.sql import QUERIES
from outbox.store import runner

SIDES = ("empty", "full")
DEFAULT_ROWS = (
    "dispatcher: claim + mark published",
    "consumer: claim",
    "reconciler: pass",
    "console: overview",
    "await_outcome",
    "ops verify OP",
)
_USES = re.compile(r"(?:using|Bitmap Index Scan on) (\w+)")
_BUFFERS = re.compile(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?")


def explain(
    connection: psycopg.Connection[Any], query: str, params: dict[str, Any]
) -> dict[str, Any]:
    """One call under EXPLAIN (ANALYZE, BUFFERS), rolled back."""
    try:
        plan = [
            str(row[0])
            for row in connection.execute(
                "EXPLAIN (ANALYZE, BUFFERS) " + QUERIES[query].sql, params
            )
        ]
    finally:
        connection.rollback()
    text = "\n".join(plan)
    # The top node's buffers are the whole plan's; planning's are on their own line.
    top = _BUFFERS.search(text.split("\nPlanning:")[0])
    hit, read = (int(n or 0) for n in top.groups()) if top else (0, 0)
    return {
        "planning": float(text.split("Planning Time: ")[1].split()[0]),
        "execution": float(text.split("Execution Time: ")[1].split()[0]),
        "hit": hit,
        "read": read,
        "indexes": sorted(set(_USES.findall(text))),
        "plan": text,
    }


def levels(connection: psycopg.Connection[Any], indexes: list[str]) -> dict[str, tuple[int, int]]:
    """Each B-tree's level and size in bytes."""
    found = {}
    for index in indexes:
        row = connection.execute(
            "SELECT (bt_metap(%(index)s)).level, pg_relation_size(%(index)s::regclass)",
            {"index": index},
        ).fetchone()
        assert row is not None
        found[index] = (int(row[0]), int(row[1]))
    return found


def measure(
    connections: dict[str, psycopg.Connection[Any]],
    lives: dict[str, LiveWorkload],
    row: str,
    warm: int,
) -> None:
    print(f"\n== {row}")
    for position, (query, _) in enumerate(lives["empty"].statements(row)):
        params = {side: lives[side].statements(row)[position][1] for side in SIDES}
        first = {side: explain(connections[side], query, params[side]) for side in SIDES}
        calls: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for _ in range(warm):
            for side in SIDES:
                calls[side].append(explain(connections[side], query, params[side]))
        print(f"  [{query}]")
        for side in SIDES:
            f, w = first[side], calls[side]
            planning = statistics.median(c["planning"] for c in w)
            execution = statistics.median(c["execution"] for c in w)
            print(
                f"    {side:<5} first: planning {f['planning']:.3f} ms, execution "
                f"{f['execution']:.3f} ms, shared hit {f['hit']} read {f['read']}; warm "
                f"(median of {warm}): planning {planning:.3f} ms, execution {execution:.3f} ms,"
                f" last shared hit {w[-1]['hit']} read {w[-1]['read']}"
            )
        indexes = sorted(set(first["empty"]["indexes"]) | set(first["full"]["indexes"]))
        depth = {side: levels(connections[side], indexes) for side in SIDES}
        for index in indexes:
            e, f_ = depth["empty"][index], depth["full"][index]
            print(
                f"    {index}: level {e[0]} empty ({e[1]:,} bytes), {f_[0]} full ({f_[1]:,} bytes)"
            )


@contextlib.contextmanager
def timed_steps() -> Iterator[dict[str, list[float]]]:
    """Every statement the store runs on a psycopg connection meanwhile, timed from the
    client (the round trip, the server's planning and execution, fetching the rows)."""
    taken: dict[str, list[float]] = defaultdict(list)
    fetch = runner._PsycopgExecutor.fetch
    fetch_async = runner._PsycopgAsyncExecutor.fetch

    def timed(self: Any, step: runner.Step) -> list[runner.Row]:
        began = time.perf_counter()
        try:
            return fetch(self, step)
        finally:
            taken[step.query].append((time.perf_counter() - began) * 1000)

    async def timed_async(self: Any, step: runner.Step) -> list[runner.Row]:
        began = time.perf_counter()
        try:
            return await fetch_async(self, step)
        finally:
            taken[step.query].append((time.perf_counter() - began) * 1000)

    runner._PsycopgExecutor.fetch = timed  # type: ignore[method-assign]
    runner._PsycopgAsyncExecutor.fetch = timed_async  # type: ignore[method-assign]
    try:
        yield taken
    finally:
        runner._PsycopgExecutor.fetch = fetch  # type: ignore[method-assign]
        runner._PsycopgAsyncExecutor.fetch = fetch_async  # type: ignore[method-assign]


def steps(urls: dict[str, str], lives: dict[str, LiveWorkload], row: str, calls: int) -> None:
    """A row's call as the bench makes it, ``calls`` times alternating between the
    databases: its median, and the median of each statement it ran, per call."""
    print(f"\n== {row}: the statements of one call, client-side")
    with (
        measurements(urls["empty"], lives["empty"]) as on_empty,
        measurements(urls["full"], lives["full"]) as on_full,
    ):
        named = {"empty": on_empty[row], "full": on_full[row]}
        totals: dict[str, list[float]] = {side: [] for side in SIDES}
        per_step: dict[str, dict[str, list[float]]] = {}
        for side in SIDES:
            named[side]()  # unmeasured: the first call opens what the others reuse
        with timed_steps() as taken:
            for _ in range(calls):
                for side in SIDES:
                    taken.clear()
                    began = time.perf_counter()
                    named[side]()
                    totals[side].append((time.perf_counter() - began) * 1000)
                    for query, times in taken.items():
                        per_step.setdefault(query, {s: [] for s in SIDES})[side].append(sum(times))
    for side in SIDES:
        total = statistics.median(totals[side])
        in_sql = sum(statistics.median(t[side]) for t in per_step.values() if t[side])
        print(
            f"  {side:<5} call {total:.3f} ms (median of {calls}); its statements' medians "
            f"add up to {in_sql:.3f} ms, the rest {total - in_sql:.3f} ms"
        )
    for query, by_side in per_step.items():
        cells = [
            f"{side} {statistics.median(by_side[side]):.3f} ms" if by_side[side] else f"{side} -"
            for side in SIDES
        ]
        print(f"    {query}: {', '.join(cells)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", type=positive_int, default=30)
    parser.add_argument("--row", action="append", help="a row of bench.history_scale")
    parser.add_argument("--plans", action="store_true", help="print the full plan's first call")
    parser.add_argument(
        "--steps",
        action="append",
        default=[],
        help="a row whose call to time statement by statement, as the bench calls it",
    )
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    urls = {
        side: with_database(args.database_url, f"outbox_bench_history_{side}") for side in SIDES
    }
    lives = {side: read_live_workload(urls[side]) for side in SIDES}
    connections = {side: psycopg.connect(urls[side]) for side in SIDES}
    try:
        for connection in connections.values():
            connection.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
            connection.commit()
        for row in args.steps:
            steps(urls, lives, row, args.warm)
        for row in args.row or ([] if args.steps else DEFAULT_ROWS):
            measure(connections, lives, row, args.warm)
            if args.plans:
                for side in SIDES:
                    for query, params in lives[side].statements(row):
                        print(
                            f"\n-- {side}, {query}:\n"
                            + explain(connections[side], query, params)["plan"]
                        )
    finally:
        for connection in connections.values():
            connection.close()


if __name__ == "__main__":
    main()
