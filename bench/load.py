"""A load generator for a staging deployment: decisions recorded at a steady rate.

    .venv/bin/python -m bench.load --database-url postgresql://agent@staging-db/outbox \\
        --tools myapp.tools --tool send_refund \\
        --input '{"payment_id": "pay_{run}_{n}", "amount_cents": 100}' \\
        --rate 20 --seconds 60 [--connections 4] [--run-id load_friday]

It records ``rate * seconds`` decisions with ``record_decision`` (each a transaction
of its own, as an agent service that commits nothing else with it), the ``n``-th due
``n / rate`` seconds after the start, whatever the previous ones cost: a database that
cannot take the rate shows as a generator that finishes late, not as a lower rate
quietly reported. The deployment's dispatcher and consumers then carry them as they
would an agent's, so the console, the metrics and the alerts show the load.

Every decision has the run id printed at the start (``--run-id``, or ``load_`` and a
random tag) and its number as decision key: the console's ``/operations?run_id=...``
and ``outbox ops list`` find them, and a rerun with the same run id records nothing new.
In ``--input``, ``{n}`` and ``{run}`` in any string value become the decision's number
and the run id, so each decision is a distinct intent (a payment the provider has not
seen). The input is validated by the tool's contract before anything is written.

Exit status: 0 when every decision was recorded no later than ``--max-late`` after its
time (default 10% of ``--seconds``, at least 1 s); 1 when it fell behind by more (raise
``--connections``, or lower ``--rate``) or the database failed; 2 for a bad flag, tool
or input (nothing written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pydantic

from outbox import Registry, record_decision_async
from outbox.cli import (
    add_setting_flags,
    add_tools_flag,
    positive_int,
    positive_seconds,
    run_async,
    run_parsed,
)
from outbox.errors import ConfigurationError, InputRefused, ToolNotRegistered
from outbox.loading import registry_from
from outbox.sandbox.scratch import new_tag
from outbox.settings import Settings
from outbox.urls import redact_url

NAME = "python -m bench.load"
# Later than this share of --seconds, the rate asked for was not the rate delivered.
LATE_SHARE = 0.10
# Far past what one generator's connections record; a typo, not a plan.
MAX_RATE = 10_000


@dataclass(frozen=True)
class Plan:
    """What one invocation records."""

    tool: str
    tool_version: int | None
    template: dict[str, Any]
    run_id: str
    rate: float
    count: int
    connections: int


@dataclass(frozen=True)
class Report:
    recorded: int
    created: int
    """Recorded now, not found from an earlier run with the same run id and key."""
    elapsed: float
    late: float
    """How long after its due time the last decision was recorded (0 when on time)."""
    latencies: list[float]


def expand(value: Any, n: int, run_id: str) -> Any:
    """``value`` with ``{n}`` and ``{run}`` in every string replaced; other text kept."""
    if isinstance(value, str):
        return value.replace("{n}", str(n)).replace("{run}", run_id)
    if isinstance(value, dict):
        return {key: expand(item, n, run_id) for key, item in value.items()}
    if isinstance(value, list):
        return [expand(item, n, run_id) for item in value]
    return value


def parse_template(text: str) -> dict[str, Any]:
    try:
        template = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputRefused(f"--input is not JSON: {error.msg} at character {error.pos}") from None
    if not isinstance(template, dict):
        raise InputRefused("--input must be a JSON object: the tool's input")
    return template


def check_plan(registry: Registry, plan: Plan) -> None:
    """Refuse an unknown tool or an input its contract refuses, before any write."""
    try:
        contract = registry.get(plan.tool, plan.tool_version)
    except ToolNotRegistered:
        names = ", ".join(sorted({c.name for c in registry})) or "none"
        raise ConfigurationError(
            f"no tool {plan.tool!r} in the tools modules given (they register: {names})"
        ) from None
    try:
        contract.parse_input(expand(plan.template, 0, plan.run_id))
    except pydantic.ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in e['loc']) or 'input'}: {e['msg']}"
            for e in error.errors()
        )
        raise InputRefused(f"the {plan.tool} contract refuses --input: {problems}") from None


async def record(url: str, registry: Registry, plan: Plan) -> Report:
    """Record ``plan.count`` decisions on schedule over ``plan.connections`` connections."""
    next_n = 0
    created = 0
    latencies: list[float] = []
    late = 0.0
    # Connected before the clock starts: the schedule measures recording, not logging in.
    connections: list[psycopg.AsyncConnection[Any]] = []
    try:
        for _ in range(plan.connections):
            connections.append(await psycopg.AsyncConnection.connect(url, autocommit=True))
    except BaseException:
        for connection in connections:
            await connection.close()
        raise
    start = time.monotonic()

    async def worker(connection: psycopg.AsyncConnection[Any]) -> None:
        nonlocal next_n, created, late
        async with connection:
            while next_n < plan.count:
                n = next_n
                next_n += 1
                due = start + n / plan.rate
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                began = time.monotonic()
                recorded = await record_decision_async(
                    connection,
                    registry,
                    plan.tool,
                    expand(plan.template, n, plan.run_id),
                    run_id=plan.run_id,
                    decision_key=str(n),
                    tool_version=plan.tool_version,
                    own_transaction=True,
                )
                finished = time.monotonic()
                latencies.append(finished - began)
                created += recorded.created
                late = max(late, finished - due)

    try:
        await asyncio.gather(*(worker(connection) for connection in connections))
    finally:
        for connection in connections:
            await connection.close()
    return Report(
        recorded=len(latencies),
        created=created,
        elapsed=time.monotonic() - start,
        late=late,
        latencies=latencies,
    )


def rate(text: str) -> float:
    """argparse type for --rate: decisions per second, more than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= MAX_RATE:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_RATE}")
    return value


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


def cmd_load(args: argparse.Namespace, settings: Settings) -> int:
    # One "operation prepared" line per decision would bury the two lines this prints.
    logging.getLogger("outbox.lifecycle").setLevel(logging.WARNING)
    registry = registry_from(settings, required=True)
    plan = Plan(
        tool=args.tool,
        tool_version=args.tool_version,
        template=parse_template(args.input),
        run_id=args.run_id or f"load_{new_tag()}",
        rate=args.rate,
        count=max(1, round(args.rate * args.seconds)),
        connections=args.connections,
    )
    check_plan(registry, plan)
    url = settings.libpq_url
    print(
        f"recording {plan.count} {plan.tool} decisions, {plan.rate:g}/s for {args.seconds:g} s, "
        f"run id {plan.run_id}, into {redact_url(url)}",
        flush=True,
    )
    report = run_async(record(url, registry, plan))
    # Over the schedule's span, not from the first to the last: n decisions span (n-1)/rate.
    achieved = report.recorded / max(report.elapsed, plan.count / plan.rate)
    again = report.recorded - report.created
    print(
        f"recorded {report.recorded} decisions in {report.elapsed:.1f} s ({achieved:.1f}/s of "
        f"{plan.rate:g}/s asked); record_decision p50 "
        f"{statistics.median(report.latencies) * 1000:.1f} ms, p99 "
        f"{percentile(report.latencies, 0.99) * 1000:.1f} ms"
        + (f"; {again} were already recorded by an earlier run with this run id" if again else "")
    )
    allowed = args.max_late if args.max_late is not None else max(1.0, LATE_SHARE * args.seconds)
    if report.late > allowed:
        print(
            f"{NAME}: fell behind: the last decision was recorded {report.late:.1f} s after its "
            "time; raise --connections or lower --rate",
            file=sys.stderr,
        )
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description="Record decisions at a steady rate into a deployment's database, for "
        "its dispatcher and consumers to carry (docs/operating.md, 'Load on a staging "
        "deployment').",
    )
    add_setting_flags(parser, "database_url", "log_level", "log_format")
    add_tools_flag(parser, used_for="the contract of --tool")
    parser.add_argument("--tool", required=True, help="the tool each decision calls")
    parser.add_argument(
        "--tool-version", type=positive_int, default=None, help="default: the latest registered"
    )
    parser.add_argument(
        "--input",
        required=True,
        metavar="JSON",
        help="the tool's input as a JSON object; {n} and {run} in its strings become the "
        "decision's number and the run id",
    )
    parser.add_argument("--rate", type=rate, required=True, help="decisions per second")
    parser.add_argument("--seconds", type=positive_seconds, required=True, help="how long")
    parser.add_argument(
        "--connections",
        type=positive_int,
        default=4,
        help="database connections recording at once (default 4)",
    )
    parser.add_argument(
        "--max-late",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="how late the slowest decision may be recorded before the run counts as "
        "fallen behind (exit 1); default 10%% of --seconds, at least 1 s",
    )
    parser.add_argument(
        "--run-id",
        default=None,
        help="the run id of every decision (default: load_ and a random tag); a rerun with "
        "the same one records nothing twice",
    )
    parser.set_defaults(handler=cmd_load)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_parsed(build_parser().parse_args(argv), NAME)


if __name__ == "__main__":
    sys.exit(main())
