"""The lists filtered by a tool, before and after ``operations_tool_settled``: the
console's page and ``outbox ops list`` for a tool with none, a rare tool and a common
one, with and without a state, and a next page, each under EXPLAIN (ANALYZE, BUFFERS).

    git show 5600e17:outbox/sql/queries.sql > /tmp/queries-5600e17.sql
    .venv/bin/python -m bench.listing_plans --before /tmp/queries-5600e17.sql
        [--operations 400000] [--repeat 5]
        [--database-url postgresql://postgres@127.0.0.1:5432/postgres | --use DATABASE_URL]

A scratch database (``outbox_bench_listing_plans``, dropped at the end) with the schema,
``--operations`` settled operations (``bench/history_fill.py``) and the live workload of
``bench/history_live.py`` (its rare tool's three committed operations, 40 open
``send_refund`` ones); or, with ``--use``, a database filled already (``bench.history_scale
--keep`` leaves one), left in place. After: this tree's ``console_tool_operations_page``
and ``list_tool_operation_summaries`` (what the store runs when a tool is given), with
the index. Before: ``console_operations_page`` and ``list_operation_summaries`` of the
file ``--before`` (an earlier commit's ``outbox/sql/queries.sql``), the index dropped
(the old queries would use it where they can), built again at the end. Each statement
runs ``--repeat`` times; the median of its execution times (JIT's included, which a plan
costed past ``jit_above_cost`` pays) is printed with the plan's scans and the pages it
read (shared hit + read) in the last run; every list's rows are compared with before's.
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path
from typing import Any

import psycopg

from bench.history_fill import fill
from bench.history_live import RARE_TOOL, start_live_workload
from outbox.cli import positive_int
from outbox.sandbox.scratch import ScratchDatabase
from outbox.sql import QUERIES, Query, parse_queries
from outbox.states import OperationState
from outbox.store.operator import tool_listing_limits

INDEX = "operations_tool_settled"
TOOLS = {"none": "no_such_tool", "rare": RARE_TOOL, "common": "send_refund"}
STATES: dict[str, list[str] | None] = {
    "": None,
    "committed": ["committed"],
    "rejected": ["rejected"],
    "prepared": ["prepared"],
}
PAGE: dict[str, Any] = {
    "run_id": None, "until": None, "after_updated_at": None, "after_id": None, "limit": 51,
}  # fmt: skip
LIST: dict[str, Any] = {"ago": None, "limit": 50}
# Each list as it was, and as the store reads it now when a tool is given.
TOOL_QUERY = {
    "console_operations_page": "console_tool_operations_page",
    "list_operation_summaries": "list_tool_operation_summaries",
}
# A scan node: its kind, and the index it reads (a bitmap's is named after "on").
_SCAN = re.compile(
    r"((?:Parallel )?(?:Seq|Index Only|Index|Bitmap Index) Scan(?: Backward)?)"
    r"(?: using (\S+))?(?: on (operations_\w+|(?!operations\b)\S+))?"
)


def cases(connection: psycopg.Connection[Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, query, parameters) of each list measured."""
    made: list[tuple[str, str, dict[str, Any]]] = []
    for tool_label, tool in TOOLS.items():
        for state_label, states in STATES.items():
            label = f"{tool_label} {state_label}".strip()
            common = {"tool": tool, "states": states, "since": None}
            made.append((f"page: {label}", "console_operations_page", {**PAGE, **common}))
            made.append((f"ops list: {label}", "list_operation_summaries", {**LIST, **common}))
    for tool_label, tool in TOOLS.items():
        # The cursor a next page starts after: the tool's second newest operation.
        row = connection.execute(
            "SELECT updated_at, id FROM operations WHERE tool_name = %(tool)s"
            " ORDER BY updated_at DESC, id DESC OFFSET 1 LIMIT 1",
            {"tool": tool},
        ).fetchone()
        if row is not None:
            cursor = {"after_updated_at": row[0], "after_id": row[1]}
            params = {**PAGE, **cursor, "tool": tool, "states": None, "since": None}
            made.append((f"page: {tool_label}, next page", "console_operations_page", params))
    for _, _, params in made:
        asked = [OperationState(s) for s in params["states"] or ()]
        params.update(tool_listing_limits(asked, params["limit"]))
    return made


def explain(
    connection: psycopg.Connection[Any], query: Query, params: dict[str, Any], repeat: int
) -> dict[str, Any]:
    taken = []
    plan: list[str] = []
    for _ in range(repeat):
        plan = [
            str(row[0])
            for row in connection.execute("EXPLAIN (ANALYZE, BUFFERS) " + query.sql, params)
        ]
        total = next(line for line in plan if line.startswith("Execution Time"))
        taken.append(float(total.split()[2]))
    rows = connection.execute(query.sql, params).fetchall()
    buffers = re.search(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?", "\n".join(plan))
    pages = sum(int(n or 0) for n in buffers.groups()) if buffers else 0
    scans = sorted(
        {
            f"{found[1]} {found[2] or found[3] or ''}".strip()
            for line in plan
            if "never executed" not in line and (found := _SCAN.search(line))
        }
    )
    if any(line.startswith("JIT:") for line in plan):
        scans.append("(compiled: JIT)")
    return {"ms": statistics.median(taken), "rows": rows, "pages": pages, "scans": scans}


def measure(url: str, before: Path, repeat: int) -> None:
    old = parse_queries(before.read_text(encoding="utf-8"))
    with psycopg.connect(url, autocommit=True) as connection:
        definition = connection.execute(
            "SELECT pg_get_indexdef(%(name)s::regclass)", {"name": INDEX}
        ).fetchone()
        assert definition is not None
        measured = cases(connection)
        after = [explain(connection, QUERIES[TOOL_QUERY[q]], p, repeat) for _, q, p in measured]
        connection.execute(f"DROP INDEX {INDEX}")
        try:
            connection.execute("ANALYZE operations")
            earlier = [explain(connection, old[q], p, repeat) for _, q, p in measured]
        finally:
            connection.execute(definition[0])
            connection.execute("ANALYZE operations")
    width = max(len(label) for label, _, _ in measured)
    print(f"{'list':<{width}}  rows  before ms  pages  after ms  pages  scans before -> after")
    for (label, _, _), b, a in zip(measured, earlier, after, strict=True):
        print(
            f"{label:<{width}}  {len(a['rows']):>4}  {b['ms']:>9.3f}  {b['pages']:>5}  "
            f"{a['ms']:>8.3f}  {a['pages']:>5}  {', '.join(b['scans'])} -> {', '.join(a['scans'])}"
        )
        if a["rows"] != b["rows"]:
            print(f"  !! not the rows of before ({len(b['rows'])})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--operations", type=positive_int, default=400_000)
    parser.add_argument("--use", help="a filled database to measure in, left in place")
    parser.add_argument(
        "--before", type=Path, required=True, help="the queries.sql to compare with"
    )
    parser.add_argument("--repeat", type=positive_int, default=5)
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    if args.use:
        measure(args.use, args.before, args.repeat)
        return
    database = ScratchDatabase(args.database_url, "outbox_bench_listing_plans")
    try:
        url = database.recreate()
        fill(url, args.operations)
        start_live_workload(url)
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute("VACUUM ANALYZE")
        print(f"{args.operations:,} settled operations and the live workload")
        measure(url, args.before, args.repeat)
    finally:
        database.drop()


if __name__ == "__main__":
    main()
