"""End to end, decision to effect: effect-outbox against the physical limit and its peers.

    .venv/bin/pip install -q -e '.[bench]' && .venv/bin/python -m bench.e2e
        [--operations 5000] [--runs 3] [--seconds 20] [--writers 2] [--systems ...]
    .venv/bin/python -m bench.e2e --scale-out [--scale-consumers 1 2 4]
        [--scale-dispatchers 1 2] [--operations 5000] [--runs 3]

Run from the repository root. The systems (bench/systems/, one class each on the
``System`` protocol) do the same job on the same Postgres and RabbitMQ, one at a time:
``minimal`` (a hand-written pipeline with no guarantees, the physical limit), ``outbox``
(effect-outbox's daemons on the product's defaults: one message per operation while the
outbox keeps up, chunks of up to 16 as a backlog forms, the default prefetch),
``outbox-single`` (the same with one message per operation always,
OUTBOX_MESSAGE_OPERATIONS=1), ``outbox-in-transaction`` (the defaults, each decision
recorded in a transaction block where ``outbox`` records it as a transaction of its
own), ``pgqueuer`` and ``procrastinate``. Every process runs on
uvloop. Per system:

1. drain: ``--operations`` decisions/jobs written in one transaction before anything
   runs (not timed), the system's processes started (consumers first, ready, then the
   relay), then the transaction committed and the backlog drained; operations/s =
   (N - 1) / (last effect - first effect), from the effect timestamps the database
   recorded. ``--runs`` rounds, each one drain of every system in turn (so that a
   machine whose speed drifts over the run moves every system alike): median and spread.
2. sustained: the processes running, ``--writers`` writer processes commit decisions as
   fast as they can for ``--sustained-seconds`` s; the effects per second recorded while
   they wrote (after a one-second warm-up). A drain's backlog was written before its
   window; here the decisions and their effects share the machine, as in any phase
   below, so this is the rate the system can be offered for good.
3. latency, at 50% and 80% of that system's median drain rate and at 50% and 80% of its
   sustained rate (or at ``--rate`` alone when given): the processes running and idle,
   ``--writers`` writer processes commit one
   decision per transaction each on one open-loop schedule (decision n due n / rate s
   after a common start) for ``--seconds`` s; decision-to-effect = effect timestamp
   (database clock) - the writer's wall clock just after its commit returned. Every
   latency line gives the offered rate, the rate achieved and the share of decisions
   written late (bench/latency.py); a run below 95% of its offered rate is labelled as
   having fallen behind, never "@N/s".

Each system gets a database of its own (``e2e_<run>_<system>``, dropped at the end) and
broker names of its own (``bench.e2e.<run>.*``, deleted at the end), on the server of
``--database-url`` (env ``OUTBOX_BENCH_DATABASE_URL``) and ``--amqp-url`` (env
``OUTBOX_BENCH_AMQP_URL``). A table on stdout; every figure, settings and the environment
in ``bench/results/e2e.json``. Exits 1 when a check failed (an operation lost, effected
twice, or a phase aborted); a broker restarted by someone else aborts that phase only.
``--py-spy DIR`` also records the effect-outbox daemons (both systems, files named after
each) with py-spy during their first drain (needs ptrace rights, e.g. root).

CPU budget: over each measured window (a drain: from the backlog's commit, every process
ready and idle, to the poll that sees the last effect; sustained and latency: from the
writers' start to the last effect) the CPU milliseconds per operation of each process group, from
``/proc`` (``bench/cpu.py``): the writers (latency only; they read their own), the
dispatcher or relay, the consumers or workers, the Postgres server's processes, the
RabbitMQ node's (the systems that use it).

``--scale-out``: effect-outbox's drain alone, for each count of consumer processes
(``--scale-consumers``) times dispatcher processes (``--scale-dispatchers``), operations/s
and the CPU budget; JSON in ``bench/results/e2e_scale_out.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from uuid import uuid4

from bench.cpu import TOTAL
from bench.e2e_phases import latency, run_phase, sustained, throughput
from bench.e2e_processes import REPOSITORY, Bench, postgres_selector, rabbitmq_selector
from bench.e2e_report import (
    environment,
    latency_line,
    ms,
    scale_out_table,
    summarize,
    summarize_throughput,
    table,
)
from bench.e2e_writers import write_on_schedule
from bench.latency import DRAIN_SHARES, rates_from_drain
from bench.reporting import json_safe
from bench.systems import SYSTEM_NAMES, Context, OutboxSettings, System, systems
from bench.systems.effect_outbox import STRIPPABLE
from outbox.cli import positive_int, run_async
from outbox.settings import libpq_url

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "e2e.json"
DEFAULT_SCALE_OUT_JSON = Path(__file__).resolve().parent / "results" / "e2e_scale_out.json"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


def child(args: argparse.Namespace) -> None:
    """A child process: ``<system>-<role>``, the role one of the system's own or
    ``writer``; the same Context as its parent's, so the same names."""
    # The role is the last part: a system's name may hold a hyphen (outbox-single).
    system_name, _, role = args.child.rpartition("-")
    context = Context(
        admin_url=args.child_url,
        amqp_url=args.amqp_url,
        run_name=args.child_run or "",
        procrastinate_concurrency=args.procrastinate_concurrency,
    )
    found = systems(context)
    if system_name not in found:
        raise SystemExit(f"unknown child {args.child!r}")
    system = found[system_name]
    if role == "writer":
        written = run_async(
            write_on_schedule(
                system,
                args.child_url,
                args.rate,
                args.seconds,
                args.writer_index,
                args.writers,
                flat_out=args.flat_out,
            )
        )
        json.dump(written, sys.stdout)
        return
    run_async(system.child(role, args.child_url))


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL),
        help="a database on the server to use (env OUTBOX_BENCH_DATABASE_URL); "
        "the benchmark creates and drops databases of its own next to it",
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("OUTBOX_BENCH_AMQP_URL", DEFAULT_AMQP_URL),
        help="RabbitMQ (env OUTBOX_BENCH_AMQP_URL)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"where to write results (default {DEFAULT_JSON.relative_to(REPOSITORY)}, "
        f"with --scale-out {DEFAULT_SCALE_OUT_JSON.relative_to(REPOSITORY)})",
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEM_NAMES, default=list(SYSTEM_NAMES))
    parser.add_argument(
        "--operations", type=positive_int, default=5_000, help="throughput: per run"
    )
    parser.add_argument("--runs", type=positive_int, default=3, help="throughput runs per system")
    parser.add_argument(
        "--rate",
        type=positive_int,
        default=None,
        help="latency: one phase at this many decisions/s (default: one phase at each of "
        + ", ".join(f"{share:g}" for share in DRAIN_SHARES)
        + " times the system's median drain rate)",
    )
    parser.add_argument(
        "--seconds", type=positive_int, default=20, help="latency: seconds per phase"
    )
    parser.add_argument(
        "--writers",
        type=positive_int,
        default=2,
        help="latency: writer processes sharing one schedule (more if one falls behind)",
    )
    parser.add_argument(
        "--sustained-seconds",
        type=int,
        default=10,
        help="latency: seconds of writers flat out to measure the sustained rate, whose "
        "shares get latency points beside the drain rate's (0: none; default 10)",
    )
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument(
        "--outbox-consumers", type=positive_int, default=1, help="effect-outbox consumer processes"
    )
    parser.add_argument(
        "--outbox-dispatchers",
        type=positive_int,
        default=1,
        help="effect-outbox dispatcher processes (they share the outbox table, SKIP LOCKED)",
    )
    parser.add_argument(
        "--outbox-prefetch",
        type=positive_int,
        default=None,
        help="effect-outbox's prefetch (default: the product's, OUTBOX_PREFETCH unset)",
    )
    parser.add_argument("--outbox-batch-size", type=positive_int, default=200)
    parser.add_argument("--outbox-lanes", type=positive_int, default=2)
    parser.add_argument(
        "--outbox-chunk",
        type=positive_int,
        default=None,
        help="the most operations per broker message of the outbox system (default: the "
        "product's, OUTBOX_MESSAGE_OPERATIONS unset)",
    )
    parser.add_argument("--outbox-log-level", default="INFO")
    parser.add_argument(
        "--outbox-without-change-notify",
        action="store_true",
        help="disable the NOTIFY that wakes await_outcome's watchers (to measure its cost)",
    )
    parser.add_argument(
        "--outbox-strip",
        nargs="+",
        choices=STRIPPABLE,
        default=[],
        help="an ablation, never a product setting: switch off the evidence chain's "
        "trigger (chain), the hot tables' other guard triggers (guards), their CHECK "
        "constraints (checks) or their FOREIGN KEYs (foreign-keys), to measure what they "
        "cost",
    )
    parser.add_argument(
        "--scale-out",
        action="store_true",
        help="instead of the comparison: effect-outbox's drain only (--operations, --runs "
        "times), for each count of consumer processes x dispatcher processes",
    )
    parser.add_argument(
        "--scale-consumers",
        type=positive_int,
        nargs="+",
        default=[1, 2, 4],
        metavar="N",
        help="--scale-out: consumer process counts (default 1 2 4)",
    )
    parser.add_argument(
        "--scale-dispatchers",
        type=positive_int,
        nargs="+",
        default=[1, 2],
        metavar="N",
        help="--scale-out: dispatcher process counts (default 1 2)",
    )
    parser.add_argument("--procrastinate-concurrency", type=positive_int, default=1)
    parser.add_argument("--py-spy", type=Path, default=None, metavar="DIR")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-url", help=argparse.SUPPRESS)
    parser.add_argument("--child-run", help=argparse.SUPPRESS)
    parser.add_argument("--writer-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--flat-out", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json is None:
        args.json = DEFAULT_SCALE_OUT_JSON if args.scale_out else DEFAULT_JSON
    return args


def main() -> None:
    args = parse_arguments()
    if args.child:
        child(args)
        return
    args.database_url = libpq_url(args.database_url)
    outbox = OutboxSettings(
        consumers=args.outbox_consumers,
        dispatchers=args.outbox_dispatchers,
        prefetch=args.outbox_prefetch,
        batch_size=args.outbox_batch_size,
        lanes=args.outbox_lanes,
        log_level=args.outbox_log_level,
        change_notify=not args.outbox_without_change_notify,
        chunk_operations=args.outbox_chunk,
        strip=tuple(args.outbox_strip),
    )
    chosen = ["outbox"] if args.scale_out else args.systems
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="outbox-e2e-") as logs:
        context = Context(
            admin_url=args.database_url,
            amqp_url=args.amqp_url,
            run_name=uuid4().hex[:8],
            procrastinate_concurrency=args.procrastinate_concurrency,
        )
        every = systems(context, outbox)
        bench = Bench(
            context=context,
            systems={name: every[name] for name in chosen},
            logs=Path(logs),
            postgres=postgres_selector(args.database_url),
            rabbitmq=rabbitmq_selector(args.amqp_url),
        )
        results: dict[str, Any] = {"environment": environment(args, bench, outbox)}
        try:
            if args.scale_out:
                results["scale_out"] = scale_out(bench, outbox, args)
            else:
                results["systems"] = compare(bench, args)
        finally:
            for system in bench.systems.values():
                system.tear_down()
    failures = bench.failures
    if args.scale_out:
        report = scale_out_table(results["scale_out"])
    else:
        summarize(results)
        report = table(results, {name: system.label for name, system in bench.systems.items()})
    results["failures"] = failures
    results["total_seconds"] = time.monotonic() - began
    print("\n" + report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(json_safe(results), indent=2, allow_nan=False) + "\n")
    print(f"\nwritten to {args.json} ({results['total_seconds']:.0f} s in all)")
    for failure in failures:
        print(f"FAILED: {failure}")
    sys.exit(1 if failures else 0)


def compare(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """The drains in rounds, one run of every system per round, so that a machine that
    speeds up or slows down over the run moves every system's figures alike; then, system
    by system, the sustained rate and latency at shares of the rates just measured (or
    at --rate)."""
    results: dict[str, Any] = {
        system: {"throughput": [], "latency": []} for system in bench.systems
    }
    for run in range(args.runs):
        for system in bench.systems.values():
            spy = args.py_spy if system.name.startswith("outbox") and run == 0 else None
            results[system.name]["throughput"] += drain_run(bench, system, args, run, spy)
    if args.skip_latency:
        return results
    for system in bench.systems.values():
        entry = results[system.name]
        summarize_throughput(entry)
        points: list[tuple[str | None, float | None, float]] = []
        if args.rate:
            points.append((None, None, float(args.rate)))
        else:
            drained = rates_from_drain(entry["per_s_median"])
            if not drained:
                bench.failures.append(f"{system.name} latency: no drain rate to take rates from")
            points += [("drain", s, r) for s, r in zip(DRAIN_SHARES, drained, strict=False)]
            if args.sustained_seconds:
                held = sustained_phase(bench, system, args)
                entry["sustained"] = held
                rate = math.nan if held is None else held["sustained_per_s"]
                points += [
                    ("sustained", s, r)
                    for s, r in zip(DRAIN_SHARES, rates_from_drain(rate), strict=False)
                ]
        for basis, share, rate in points:
            print(f"{system.name}: latency, {rate:g}/s for {args.seconds:g} s", flush=True)
            measured = run_phase(
                f"{system.name} latency @{rate:g}/s",
                bench.failures,
                functools.partial(latency, bench, system, rate, args.seconds, args.writers),
            )
            if measured is None:
                continue
            measured["share_of"] = basis
            measured["drain_share"] = share
            entry["latency"].append(measured)
            bench.failures.extend(measured["failures"])
            print(
                f"  {latency_line(measured)}, "
                f"{ms(measured['cpu']['cpu_ms_per_op'][TOTAL])} CPU ms/op",
                flush=True,
            )
    return results


def drain_run(
    bench: Bench, system: System, args: argparse.Namespace, run: int, py_spy: Path | None
) -> list[dict[str, Any]]:
    """One drain of ``--operations`` (py-spy on it if asked); empty if it died."""
    print(f"{system.name}: drain run {run + 1}/{args.runs}", flush=True)
    measured = run_phase(
        f"{system.name} throughput",
        bench.failures,
        functools.partial(throughput, bench, system, args.operations, py_spy),
    )
    if measured is None:
        return []
    bench.failures.extend(measured["failures"])
    budget = measured["cpu"]["cpu_ms_per_op"]
    print(f"  {measured['per_s']:,.0f} ops/s, {ms(budget[TOTAL])} CPU ms/op", flush=True)
    return [measured]


def sustained_phase(
    bench: Bench, system: System, args: argparse.Namespace
) -> dict[str, Any] | None:
    print(
        f"{system.name}: sustained, {args.writers} writers flat out for "
        f"{args.sustained_seconds:g} s",
        flush=True,
    )
    held = run_phase(
        f"{system.name} sustained",
        bench.failures,
        functools.partial(sustained, bench, system, args.sustained_seconds, args.writers),
    )
    if held is not None:
        bench.failures.extend(held["failures"])
        print(
            f"  {held['sustained_per_s']:,.0f} effects/s sustained while "
            f"{held['written_per_s']:,.0f} decisions/s were written, "
            f"{ms(held['cpu']['cpu_ms_per_op'][TOTAL])} CPU ms/op",
            flush=True,
        )
    return held


def scale_out(
    bench: Bench, outbox: OutboxSettings, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """effect-outbox's drain for each (consumer processes, dispatcher processes)."""
    points: list[dict[str, Any]] = []
    for consumers in args.scale_consumers:
        for dispatchers in args.scale_dispatchers:
            # The Outbox system holds this same settings object: it starts these counts.
            outbox.consumers, outbox.dispatchers = consumers, dispatchers
            print(f"{consumers} consumer(s), {dispatchers} dispatcher(s)", flush=True)
            point: dict[str, Any] = {"consumers": consumers, "dispatchers": dispatchers}
            point["throughput"] = [
                measured
                for run in range(args.runs)
                for measured in drain_run(bench, bench.systems["outbox"], args, run, None)
            ]
            summarize_throughput(point)
            points.append(point)
    return points


if __name__ == "__main__":
    main()
