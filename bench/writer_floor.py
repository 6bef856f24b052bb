"""The writer's client CPU per decision, and how much of it is the driver's:

    .venv/bin/python -m bench.writer_floor [--decisions 3000] [--rounds 3]
        [--database-url postgresql://localhost:5432/postgres]

One connection, each decision a transaction of its own (autocommit), one after another,
in one uvloop process, in alternating rounds; the process's own CPU (user + system) per
decision, in µs:

- ``record_decision_async``: what an agent service's writer runs (``own_transaction``):
  validation, canonical form, fingerprint, the plan runner, the statement;
- ``insert_decision, psycopg``: the same statement with its parameters built, prepared,
  on psycopg's async connection (the driver the runtime uses);
- ``insert_decision, asyncpg``: the same statement and parameters on asyncpg;
- ``pgqueuer enqueue``: what bench/e2e.py's pgqueuer writer runs (asyncpg).

The first minus the second is the runtime's own Python; the second minus the third is
the driver's. Creates and drops a scratch database (``writer_floor_<tag>``) on the
server of ``--database-url``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.e2e_tools import TOOL, build_registry
from outbox import record_decision_async
from outbox.bounds import DECISION_LOCK_TIMEOUT
from outbox.cli import positive_int
from outbox.sandbox.scratch import ScratchDatabase, new_tag
from outbox.settings import libpq_url
from outbox.sql import QUERIES

Decide = Callable[[int], Awaitable[object]]
PARAMETER = re.compile(r"%\((\w+)\)s")


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def positional(sql: str) -> tuple[str, list[str]]:
    """``sql`` with psycopg's named parameters as asyncpg's numbered ones, and the names
    in their numbers' order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return PARAMETER.sub(number, sql), names


def statement_parameters(run_id: str, n: int) -> dict[str, Any]:
    """What record_decision sends for bench/e2e.py's decision, built in advance."""
    return {
        "id": uuid.uuid4(),
        "run_id": run_id,
        "decision_key": f"k{n}",
        "tool_name": TOOL,
        "tool_version": 1,
        "side_effect": "deduplicated_write",
        "input": {"n": n},
        "input_fingerprint": "0" * 64,
        "requires_approval": False,
        "headers": {},
        "lock_timeout_ms": round(DECISION_LOCK_TIMEOUT * 1000),
    }


async def cpu_us_per_decision(decide: Decide, first: int, count: int) -> float:
    began = process_cpu_seconds()
    for n in range(first, first + count):
        await decide(n)
    return (process_cpu_seconds() - began) * 1e6 / count


async def measure(url: str, decisions: int, rounds: int) -> dict[str, list[float]]:
    import asyncpg
    from pgqueuer import Queries

    registry = build_registry()
    tag = uuid.uuid4().hex[:8]
    psycopg_connection = await psycopg.AsyncConnection.connect(url, autocommit=True)
    asyncpg_connection = await asyncpg.connect(url)
    try:
        queue = Queries.from_asyncpg_connection(asyncpg_connection)
        await queue.install()
        sql = QUERIES["insert_decision"].sql
        numbered, names = positional(sql)

        async def whole(n: int) -> object:
            return await record_decision_async(
                psycopg_connection,
                registry,
                TOOL,
                {"n": n},
                run_id=f"whole_{tag}",
                decision_key=f"k{n}",
                own_transaction=True,
            )

        async def on_psycopg(n: int) -> object:
            params = statement_parameters(f"psycopg_{tag}", n)
            params["input"], params["headers"] = Jsonb(params["input"]), Jsonb(params["headers"])
            cursor = await psycopg_connection.execute(sql, params, prepare=True)
            return await cursor.fetchall()

        async def on_asyncpg(n: int) -> object:
            params = statement_parameters(f"asyncpg_{tag}", n)
            params["input"] = json.dumps(params["input"])
            params["headers"] = json.dumps(params["headers"])
            return await asyncpg_connection.fetch(numbered, *(params[name] for name in names))

        async def enqueue(n: int) -> object:
            return await queue.enqueue("noop", uuid.uuid4().bytes)

        ways: dict[str, Decide] = {
            "record_decision_async": whole,
            "insert_decision, psycopg": on_psycopg,
            "insert_decision, asyncpg": on_asyncpg,
            "pgqueuer enqueue": enqueue,
        }
        figures: dict[str, list[float]] = {name: [] for name in ways}
        # A warm-up of every way first (prepared statements, caches), on keys of its own.
        for decide in ways.values():
            await cpu_us_per_decision(decide, 10 * decisions * (rounds + 1), decisions // 10)
        for round_number in range(rounds):
            for name, decide in ways.items():
                first = round_number * decisions
                figures[name].append(await cpu_us_per_decision(decide, first, decisions))
        return figures
    finally:
        await psycopg_connection.close()
        await asyncpg_connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_BENCH_DATABASE_URL", "postgresql://localhost:5432/postgres"),
        help="a database on the server (env OUTBOX_BENCH_DATABASE_URL); a scratch one is "
        "created beside it",
    )
    parser.add_argument("--decisions", type=positive_int, default=3000)
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args()
    import uvloop

    with ScratchDatabase(libpq_url(args.database_url), f"writer_floor_{new_tag()}") as scratch:
        figures = uvloop.run(measure(scratch.url, args.decisions, args.rounds))
    print("client CPU µs per decision, each round; median")
    for name, values in figures.items():
        rounded = ", ".join(f"{value:.1f}" for value in values)
        print(f"  {name:26s} {rounded}; {statistics.median(values):.1f}")


if __name__ == "__main__":
    main()
