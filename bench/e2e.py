"""End to end, decision to effect: effect-outbox against the physical limit and its peers.

    .venv/bin/pip install -q -e '.[bench]' && .venv/bin/python -m bench.e2e
        [--operations 5000] [--runs 3] [--seconds 20] [--writers 2] [--systems ...]
    .venv/bin/python -m bench.e2e --scale-out [--scale-consumers 1 2 4]
        [--scale-dispatchers 1 2] [--operations 5000] [--runs 3]

Run from the repository root. The systems (bench/systems.py, one class each on the
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
import asyncio
import contextlib
import functools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit
from uuid import uuid4

import psycopg

from bench.cpu import (
    CLOCK_TICKS,
    TOTAL,
    AnyOf,
    Named,
    Pids,
    ProcessGroups,
    Selector,
    Usage,
    cpu_seconds,
    listening_sockets,
    read_stat,
    scan,
    socket_owners,
)
from bench.latency import (
    DRAIN_SHARES,
    KEPT_RATE_SHARE,
    LATE_TOLERANCE_S,
    Lateness,
    Pace,
    achieved_rate,
    due_at,
    rates_from_drain,
    scheduled,
    sustained_rate,
)
from bench.reporting import json_safe, percentile
from bench.systems import (
    MINIMAL_BATCH,
    MINIMAL_PREFETCH,
    READY,
    SYSTEM_NAMES,
    Context,
    OutboxSettings,
    System,
    ready_marker,
    systems,
)
from outbox.cli import positive_int, run_async
from outbox.sandbox.processes import DaemonProcess, stop_all
from outbox.settings import libpq_url

T = TypeVar("T")

MODULE = "bench.e2e"
REPOSITORY = Path(__file__).resolve().parents[1]
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "e2e.json"
DEFAULT_SCALE_OUT_JSON = Path(__file__).resolve().parent / "results" / "e2e_scale_out.json"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
# The CPU budget's process groups: the writers (in the latency window only: the drain's
# backlog is written before its window), the dispatcher (the minimal pipeline's relay;
# pgqueuer and procrastinate have none), the consumers (the peers' workers), every
# process of the Postgres server and of the RabbitMQ node.
CPU_GROUPS = ("writer", "dispatcher", "consumers", "postgres", "rabbitmq")
# The RabbitMQ nodes on this machine (not the Erlang VMs that rabbitmqctl runs), and their
# port mapper.
RABBITMQ_NODES = Named(frozenset({"beam.smp"}), arguments=("rabbit", "boot"))
EPMD = Named(frozenset({"epmd"}))
POSTGRES_PROCESSES = frozenset({"postgres", "postmaster"})
# After the writers stop, how long effects may still take.
SETTLE_SECONDS = 60.0
# The schedule starts this long after the last writer said it was ready (connected), so
# that no writer's start-up eats into it.
WRITER_LEAD_SECONDS = 0.2
PACKAGES = ("aio-pika", "aiormq", "psycopg", "uvloop", "asyncpg", "pgqueuer", "procrastinate")


# --- the writers (children) ----------------------------------------------------------


async def write_on_schedule(
    system: System,
    url: str,
    rate: float,
    seconds: float,
    writer: int,
    writers: int,
    *,
    flat_out: bool = False,
) -> dict[str, Any]:
    """This writer's share of one open-loop schedule, one decision per transaction (or,
    ``flat_out``, of as many decisions as the writers manage in ``seconds``).

    Connected, it says so (stderr) and reads the schedule's origin from stdin: the
    monotonic time the parent chose once every writer was ready (CLOCK_MONOTONIC is one
    clock for the whole machine, so the writers and the parent share it)."""
    commits: dict[str, float] = {}
    mine = [] if flat_out else scheduled(rate, seconds, writer, writers)
    enqueue, close = await system.writer(url)
    lateness = Lateness()
    try:
        ready_marker()
        origin = float(await asyncio.to_thread(sys.stdin.readline))
        # The writer's CPU over its schedule only (not its start-up): this process and
        # anything below it, read from /proc as the parent reads the daemons'.
        cpu_began = cpu_seconds([os.getpid()])
        if flat_out:
            # As fast as this writer can, each decision as soon as the last committed, for
            # ``seconds`` from the origin: no schedule to be late against.
            wait = origin - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            n, stop = writer, origin + seconds
            while time.monotonic() < stop:
                key = await enqueue(n)
                commits[key] = time.time()
                n += writers
        else:
            for n in mine:
                due = due_at(origin, rate, n)
                now = time.monotonic()
                if due > now:
                    await asyncio.sleep(due - now)
                    now = time.monotonic()
                lateness.record(due, now)
                key = await enqueue(n)
                commits[key] = time.time()
        finished = time.monotonic()
        cpu = cpu_seconds([os.getpid()]) - cpu_began
    finally:
        await close()
    return {
        "commits": commits,
        "origin_monotonic": origin,
        "finished_monotonic": finished,
        "cpu_seconds": cpu,
        "late": lateness.as_dict(),
    }


def run_writers(
    system: str, url: str, rate: float, seconds: float, writers: int, *, flat_out: bool = False
) -> dict[str, Any]:
    """``writers`` processes on one schedule (or flat out), started once all are
    connected; what they wrote, merged."""
    children = [
        subprocess.Popen(  # noqa: S603 - this interpreter, fixed arguments
            [
                sys.executable,
                "-m",
                MODULE,
                "--child",
                f"{system}-writer",
                "--child-url",
                url,
                # Whole numbers: the rates are (bench.latency.rates_from_drain, --rate).
                "--rate",
                str(round(rate)),
                "--seconds",
                str(round(seconds)),
                "--writer-index",
                str(index),
                "--writers",
                str(writers),
                *(["--flat-out"] if flat_out else []),
            ],
            cwd=REPOSITORY,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for index in range(writers)
    ]
    early = [wait_for_ready_line(child) for child in children]
    start = f"{time.monotonic() + WRITER_LEAD_SECONDS!r}\n".encode()
    for child in children:  # every writer has its start before any is waited for
        assert child.stdin is not None
        child.stdin.write(start)
        child.stdin.flush()
    outputs = [child.communicate() for child in children]
    outputs = [(out, before + err) for before, (out, err) in zip(early, outputs, strict=True)]
    for child, (_, stderr) in zip(children, outputs, strict=True):
        if child.returncode != 0:
            raise RuntimeError(f"a writer failed:\n{stderr.decode()[-2000:]}")
    written = [json.loads(stdout) for stdout, _ in outputs]
    lateness = Lateness()
    commits: dict[str, float] = {}
    for one in written:
        lateness.merge(Lateness.from_dict(one["late"]))
        commits.update(one["commits"])
    origin = min(float(one["origin_monotonic"]) for one in written)
    finished = max(float(one["finished_monotonic"]) for one in written)
    pace = Pace(rate, achieved_rate(len(commits), origin, finished), lateness)
    return {
        "commits": commits,
        "pace": pace,
        "cpu_seconds": sum(float(one["cpu_seconds"]) for one in written),
    }


def wait_for_ready_line(child: subprocess.Popen[bytes]) -> bytes:
    """What the child wrote to stderr up to its ready line (all of it if it died first)."""
    assert child.stderr is not None
    before = b""
    for line in iter(child.stderr.readline, b""):
        if line.strip() == READY.encode():
            break
        before += line
    return before


# --- processes (parent) --------------------------------------------------------------


@dataclass
class Bench:
    context: Context
    systems: dict[str, System]
    logs: Path
    # The Postgres server's processes: its postmaster (found from a backend of ours) and
    # everything below it, or, if that is not visible here, every process so named.
    postgres: Selector = field(default_factory=lambda: Named(POSTGRES_PROCESSES))
    # The RabbitMQ node that listens on --amqp-url's port, with epmd.
    rabbitmq: Selector = field(default_factory=lambda: AnyOf((RABBITMQ_NODES, EPMD)))
    failures: list[str] = field(default_factory=list)
    spawned: int = 0

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> DaemonProcess:
        self.spawned += 1
        log = self.logs / f"{self.spawned:03d}-{name}.log"
        return DaemonProcess(argv, environment=env, log=log, cwd=REPOSITORY, name=name)

    @contextlib.contextmanager
    def running(self, system: System, url: str) -> Iterator[Running]:
        """The system's processes, stage by stage, each stage ready before the next
        starts; stopped (SIGTERM, then SIGKILL) on the way out."""
        running = Running()
        try:
            for stage in system.daemons(url):
                started = [
                    (
                        daemon.group,
                        self.spawn(
                            f"{system.name}-{daemon.name}", daemon.argv, dict(daemon.environment)
                        ),
                        daemon.ready_line,
                    )
                    for daemon in stage
                ]
                for group, child, _ in started:
                    running.add(group, child)
                wait_ready([(child, marker) for _, child, marker in started])
            yield running
        finally:
            stop_all(running.children)

    def process_groups(self, system: System, running: Running) -> ProcessGroups:
        """The CPU groups of a window: the system's daemons, Postgres, and RabbitMQ for
        the systems that use it (the writers, when in the window, measure themselves)."""
        groups: dict[str, Selector] = {
            group: Pids(tuple(child.pid for child in children))
            for group, children in running.groups.items()
        }
        groups["postgres"] = self.postgres
        if system.uses_broker:
            groups["rabbitmq"] = self.rabbitmq
        return ProcessGroups(groups)


@dataclass
class Running:
    """A system's daemons, each in its CPU group."""

    children: list[DaemonProcess] = field(default_factory=list)
    groups: dict[str, list[DaemonProcess]] = field(default_factory=dict)

    def add(self, group: str, child: DaemonProcess) -> None:
        self.children.append(child)
        self.groups.setdefault(group, []).append(child)


def postgres_selector(url: str) -> Selector:
    """The server's postmaster, the parent of the backend that serves this connection,
    if this machine sees it (a server elsewhere, or in a container of its own, is not
    seen: then every process named postgres)."""
    with psycopg.connect(url, autocommit=True) as connection:
        row = connection.execute("SELECT pg_backend_pid()").fetchone()
        backend = read_stat(int(row[0])) if row else None
        if backend is not None and backend.comm in POSTGRES_PROCESSES:
            postmaster = read_stat(backend.ppid)
            if postmaster is not None and postmaster.comm in POSTGRES_PROCESSES:
                return Pids((postmaster.pid,), "the postmaster and every process below it")
    return Named(POSTGRES_PROCESSES)


def rabbitmq_selector(amqp_url: str) -> Selector:
    """The node that listens on the URL's port, if this machine shows which one it is
    (reading its descriptors takes root); else every RabbitMQ node here. With epmd."""
    split = urlsplit(amqp_url)
    port = split.port or (5671 if split.scheme == "amqps" else 5672)
    nodes = RABBITMQ_NODES.roots(scan())
    owners = socket_owners(listening_sockets(port), nodes)
    node = Pids(tuple(owners), f"the RabbitMQ node listening on port {port}")
    return AnyOf((node if owners else RABBITMQ_NODES, EPMD))


def wait_ready(children: Sequence[tuple[DaemonProcess, str]], within: float = 30.0) -> None:
    """Each child has written its ready line, all within ``within`` seconds."""
    deadline = time.monotonic() + within
    for child, marker in children:
        child.wait_for_line(marker, within=max(0.0, deadline - time.monotonic()))


def wait_for_effects(
    connection: psycopg.Connection[Any], system: System, expected: int, within: float
) -> int:
    """Effects recorded, polled on one open connection (a connection per poll would
    fork a backend each time, Postgres CPU inside the measured window)."""
    deadline = time.monotonic() + within
    done = system.count_effects(connection)
    while done < expected and time.monotonic() < deadline:
        time.sleep(0.2)
        done = system.count_effects(connection)
    return done


def cpu_budget(usage: Usage, operations: int) -> dict[str, Any]:
    """A window's CPU: seconds and ms per operation by group (and in all), how many
    CPUs the groups kept busy, roots that were gone by the window's end."""
    seconds = {group: usage.cpu[group] for group in CPU_GROUPS if group in usage.cpu}
    per_op = usage.ms_per_op(operations)
    return {
        "window_seconds": usage.seconds,
        "operations": operations,
        "cpu_seconds": {**seconds, TOTAL: usage.total},
        "cpu_ms_per_op": {group: per_op[group] for group in (*seconds, TOTAL)},
        "cores_busy": usage.cores_busy(),
        "lost_processes": usage.lost,
        "unseen_groups": usage.unseen,
    }


# --- phases (parent) -----------------------------------------------------------------


def throughput(bench: Bench, system: System, count: int, py_spy: Path | None) -> dict[str, Any]:
    url = system.set_up()
    profilers: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        began = time.monotonic()
        backlog = stack.enter_context(contextlib.ExitStack())
        held = backlog.enter_context(system.backlog(url, count))
        inserted = time.monotonic() - began
        running = stack.enter_context(bench.running(system, url))
        watch = stack.enter_context(psycopg.connect(url, autocommit=True))
        if py_spy is not None:
            profilers = start_py_spy(running.children, py_spy)
        # The CPU window: every process ready and idle, from the backlog's commit to the
        # poll that sees the last effect. (procrastinate's backlog is committed already:
        # its worker drains from its start, and what it did before this is left out,
        # with the effects recorded by then.)
        groups = bench.process_groups(system, running)
        start = groups.snapshot()
        before = system.count_effects(watch)
        backlog.close()  # commits
        done = wait_for_effects(watch, system, count, within=max(60.0, count / 50))
        end = groups.snapshot()
        for profiler in profilers:
            profiler.send_signal(signal.SIGINT)
        for profiler in profilers:
            profiler.wait(timeout=60)
    times = sorted(system.effect_times(url).values())
    problems = [] if done == count else [f"{done} of {count} effects recorded"]
    problems += system.check(url, count)
    span = times[-1] - times[0] if len(times) > 1 else math.nan
    return {
        "operations": count,
        "effects": len(times),
        "seconds": span,
        "per_s": (len(times) - 1) / span if span and span > 0 else math.nan,
        "backlog_insert_seconds": inserted,
        "backlog_committed_in_window": held,
        "cpu": cpu_budget(groups.delta(start, end), done - before),
        "py_spy": bool(profilers),
        "failures": [f"{system.name} throughput: {p}" for p in problems],
    }


def start_py_spy(
    children: Sequence[DaemonProcess], directory: Path
) -> list[subprocess.Popen[bytes]]:
    directory.mkdir(parents=True, exist_ok=True)
    py_spy = Path(sys.executable).parent / "py-spy"
    return [
        subprocess.Popen(  # noqa: S603 - the venv's py-spy, fixed arguments
            [
                str(py_spy),
                "record",
                "--pid",
                str(child.pid),
                "--rate",
                "200",
                "--nonblocking",
                "--format",
                "raw",
                "--output",
                str(directory / f"{child.name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for child in children
    ]


@dataclass
class Written:
    """A phase of writers with the system running: what they committed and when, the
    effects' times, the CPU window, and what went wrong."""

    url: str
    commits: dict[str, float]
    pace: Pace
    effects: dict[str, float]
    cpu: dict[str, Any]
    problems: list[str]


def write_while_running(
    bench: Bench, system: System, rate: float, seconds: float, writers: int, *, flat_out: bool
) -> Written:
    url = system.set_up()
    with (
        bench.running(system, url) as running,
        psycopg.connect(url, autocommit=True) as watch,
    ):
        time.sleep(0.5)  # let the freshly started consumers settle on their queue
        # The CPU window: from the writers' launch to the poll that sees the last effect.
        groups = bench.process_groups(system, running)
        start = groups.snapshot()
        before = system.count_effects(watch)
        written = run_writers(system.name, url, rate, seconds, writers, flat_out=flat_out)
        commits: dict[str, float] = written["commits"]
        done = wait_for_effects(watch, system, len(commits), within=SETTLE_SECONDS)
        usage = groups.delta(start, groups.snapshot())
    # The writers exited inside the window (this process reaped them): each measured its
    # own writing's CPU.
    usage.cpu["writer"] = float(written["cpu_seconds"])
    problems = [] if done >= len(commits) else [f"{len(commits) - done} effects missing"]
    problems += system.check(url, len(commits))
    return Written(
        url=url,
        commits=commits,
        pace=written["pace"],
        effects=system.effect_times(url),
        cpu=cpu_budget(usage, done - before),
        problems=problems,
    )


def sustained(bench: Bench, system: System, seconds: float, writers: int) -> dict[str, Any]:
    """The rate the system turns decisions into effects while it also takes them in:
    ``writers`` writers flat out for ``seconds`` (bench.latency.sustained_rate)."""
    written = write_while_running(bench, system, 1.0, seconds, writers, flat_out=True)
    commits = written.commits
    return {
        "seconds": seconds,
        "writers": writers,
        "decisions": len(commits),
        "written_per_s": written.pace.achieved_per_s,
        "sustained_per_s": sustained_rate(commits.values(), written.effects.values()),
        "cpu": written.cpu,
        "failures": [f"{system.name} sustained: {p}" for p in written.problems],
    }


def latency(
    bench: Bench, system: System, rate: float, seconds: float, writers: int
) -> dict[str, Any]:
    written = write_while_running(bench, system, rate, seconds, writers, flat_out=False)
    commits, pace, effects = written.commits, written.pace, written.effects
    latencies = sorted(effects[key] - at for key, at in commits.items() if key in effects)
    problems = written.problems

    def ms(value: float) -> float:
        return round(value * 1000, 2)

    return {
        "offered_per_s": rate,
        "seconds": seconds,
        "writers": writers,
        "decisions": len(commits),
        "achieved_per_s": pace.achieved_per_s,
        "kept_schedule": pace.kept,
        "label": pace.label(),
        "writer_late": {**pace.lateness.as_dict(), "share": pace.late_share},
        "effects": len(latencies),
        "decision_to_effect_ms": {
            "p50": ms(percentile(latencies, 0.50)),
            "p90": ms(percentile(latencies, 0.90)),
            "p99": ms(percentile(latencies, 0.99)),
            "max": ms(latencies[-1]) if latencies else math.nan,
            "min": ms(latencies[0]) if latencies else math.nan,
        },
        "stages_ms": system.stages(written.url),
        "cpu": written.cpu,
        "failures": [f"{system.name} latency @{rate:g}/s: {p}" for p in problems],
    }


def pace_of(measured: dict[str, Any]) -> Pace:
    """The Pace a latency result was measured at, back from its JSON."""
    late = measured["writer_late"]
    return Pace(
        measured["offered_per_s"],
        measured["achieved_per_s"],
        Lateness.from_dict(
            {key: late[key] for key in ("tolerance_ms", "decisions", "late", "worst_ms")}
        ),
    )


def latency_line(measured: dict[str, Any]) -> str:
    """p50 / p99 / max, labelled with the rate only if the writers kept it, and always
    the offered and achieved rates and the share written late beside them."""
    figures = measured["decision_to_effect_ms"]
    pace = pace_of(measured)
    return (
        f"{figures['p50']:,.1f} / {figures['p99']:,.1f} / {figures['max']:,.1f} ms "
        f"{pace.label()} ({pace.describe()}; "
        f"{measured['effects']:,}/{measured['decisions']:,} effects)"
    )


def run_phase(name: str, failures: list[str], phase: Callable[[], T]) -> T | None:
    """One phase; one that dies (the broker restarted under it, say) is a failure and
    the phases after it still run."""
    try:
        return phase()
    except Exception as error:
        failures.append(f"{name}: aborted by {type(error).__name__}: {error}")
        print(f"FAILED: {failures[-1]}", flush=True)
        return None


# --- report --------------------------------------------------------------------------


def summarize_throughput(entry: dict[str, Any]) -> None:
    """Median and spread of the runs' operations/s; the CPU budget of the run whose
    total CPU per operation is the median (lower middle of an even count), so that its
    groups add up to its total."""
    rates = [run["per_s"] for run in entry["throughput"] if not math.isnan(run["per_s"])]
    if rates:
        entry["per_s_median"] = statistics.median(rates)
        entry["per_s_min"] = min(rates)
        entry["per_s_max"] = max(rates)
    else:
        entry["per_s_median"] = math.nan
    runs = entry["throughput"]
    measured = sorted(
        (
            index
            for index, run in enumerate(runs)
            if not math.isnan(run["cpu"]["cpu_ms_per_op"][TOTAL])
        ),
        key=lambda index: runs[index]["cpu"]["cpu_ms_per_op"][TOTAL],
    )
    median = measured[(len(measured) - 1) // 2] if measured else None
    entry["cpu_median_run"] = median
    cpu = entry.setdefault("cpu_ms_per_op", {})
    cpu["throughput"] = runs[median]["cpu"]["cpu_ms_per_op"] if median is not None else {}


def phase_name(measured: dict[str, Any]) -> str:
    """A latency point's name: its share of the drain or sustained rate, or the rate it
    was asked for."""
    share = measured.get("drain_share")
    if share is None:
        return f"@{measured['offered_per_s']:g}/s"
    return f"@{share:.0%} {measured.get('share_of', 'drain')}"


def summarize(results: dict[str, Any]) -> None:
    for entry in results["systems"].values():
        summarize_throughput(entry)
        if entry.get("sustained"):
            entry["cpu_ms_per_op"]["sustained"] = entry["sustained"]["cpu"]["cpu_ms_per_op"]
        for measured in entry.get("latency", []):
            entry["cpu_ms_per_op"][phase_name(measured)] = measured["cpu"]["cpu_ms_per_op"]
    median = {s: e["per_s_median"] for s, e in results["systems"].items()}
    held = {
        s: e["sustained"]["sustained_per_s"]
        for s, e in results["systems"].items()
        if e.get("sustained")
    }
    pairs = [(system, "minimal") for system in results["systems"] if system != "minimal"]
    pairs += [
        (outbox, peer)
        for outbox in ("outbox", "outbox-single", "outbox-in-transaction")
        for peer in ("pgqueuer", "procrastinate")
    ]
    pairs += [("outbox-in-transaction", "outbox")]
    pairs = [(a, b) for a, b in pairs if a in results["systems"] and b in results["systems"]]
    results["ratios"] = {f"{a}/{b}": median[a] / median[b] for a, b in pairs}
    results["sustained_ratios"] = {
        f"{a}/{b}": held[a] / held[b] for a, b in pairs if a in held and b in held and held[b]
    }
    # CPU per operation, the same pairs and phases: how many times the CPU the other spends.
    cpu_ratios: dict[str, dict[str, float]] = {}
    for a, b in pairs:
        mine, theirs = (results["systems"][s]["cpu_ms_per_op"] for s in (a, b))
        cpu_ratios[f"{a}/{b}"] = {
            phase: mine[phase][TOTAL] / theirs[phase][TOTAL]
            for phase in mine
            if mine[phase] and theirs.get(phase) and theirs[phase][TOTAL] > 0
        }
    results["cpu_ratios"] = cpu_ratios


def table(results: dict[str, Any], labels: dict[str, str]) -> str:
    lines = [("system", "operations/s, median (runs)")]
    for system, entry in results["systems"].items():
        runs = ", ".join(f"{run['per_s']:,.0f}" for run in entry["throughput"])
        rate = f"{entry['per_s_median']:,.0f} ({runs})" if entry["throughput"] else "-"
        lines.append((labels[system], rate))
    out = columns(lines, left={0, 1})
    sustained_lines = [
        f"  {labels[system]}: {held['sustained_per_s']:,.0f} effects/s while "
        f"{held['written_per_s']:,.0f} decisions/s were written"
        for system, entry in results["systems"].items()
        if (held := entry.get("sustained"))
    ]
    if sustained_lines:
        out += ["", "sustained (writers flat out, decisions and effects on one machine):"]
        out += sustained_lines
    out += ["", "decision -> effect, p50 / p99 / max:"]
    for system, entry in results["systems"].items():
        for measured in entry.get("latency", []):
            out.append(f"  {labels[system]} {phase_name(measured)}: {latency_line(measured)}")
            stages = measured.get("stages_ms")
            if stages:
                out.append(
                    "    stages, p50 / p99: "
                    + ", ".join(
                        f"{name} {v['p50']:,.1f} / {v['p99']:,.1f} ms" for name, v in stages.items()
                    )
                )
    out.append("")
    for name, ratio in results["ratios"].items():
        left, right = name.split("/")
        held = results.get("sustained_ratios", {}).get(name)
        beside = "" if held is None else f" (sustained {held:.2f}x)"
        out.append(f"{labels[left]} / {labels[right]}: {ratio:.2f}x{beside}")
    out += ["", *cpu_table(results, labels)]
    return "\n".join(out)


def ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def columns(lines: Sequence[Sequence[str]], left: set[int]) -> list[str]:
    """Lines of cells in columns three spaces apart: text to the left, figures to the right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return [
        "   ".join(
            cell.ljust(widths[i]) if i in left else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        ).rstrip()
        for line in lines
    ]


def windows(entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A system's CPU windows by phase: the drain's median run, then each latency point."""
    median = entry.get("cpu_median_run")
    found = [] if median is None else [("drain", entry["throughput"][median]["cpu"])]
    if entry.get("sustained"):
        found.append(("sustained", entry["sustained"]["cpu"]))
    return found + [(phase_name(m), m["cpu"]) for m in entry.get("latency", [])]


def cpu_table(results: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """CPU ms per operation by group: the drain's median run, and each latency window."""
    header = ("system", "phase", "total", *CPU_GROUPS, "cores busy")
    lines: list[tuple[str, ...]] = [header]
    for system, entry in results["systems"].items():
        label = labels[system]
        for phase, budget in windows(entry):
            per_op = budget["cpu_ms_per_op"]
            lines.append(
                (
                    label,
                    phase,
                    ms(per_op[TOTAL]),
                    *(ms(per_op.get(group)) for group in CPU_GROUPS),
                    f"{budget['cores_busy']:.2f}",
                )
            )
            label = ""
    out = [
        "CPU ms per operation, /proc utime+stime (drain: the median run by total; "
        "sustained: writers flat out; @N% drain / sustained: the latency window at that "
        "share of the rate)",
        *columns(lines, left={0, 1}),
    ]
    for name, phases in results.get("cpu_ratios", {}).items():
        left, right = name.split("/")
        figures = ", ".join(
            f"{'drain' if phase == 'throughput' else phase} {ratio:.2f}x"
            for phase, ratio in phases.items()
        )
        out.append(f"CPU per operation, {labels[left]} / {labels[right]}: {figures or '-'}")
    lost = [
        f"{system} {phase}: {groups}"
        for system, entry in results["systems"].items()
        for phase, budget in (
            *(("drain", run["cpu"]) for run in entry["throughput"]),
            *(("sustained", held["cpu"]) for held in [entry.get("sustained")] if held),
            *((phase_name(m), m["cpu"]) for m in entry.get("latency", [])),
        )
        if (groups := budget["lost_processes"])
    ]
    if lost:
        out.append(
            "processes gone before their window ended (CPU undercounted): " + "; ".join(lost)
        )
    return out


def environment(args: argparse.Namespace, bench: Bench, outbox: OutboxSettings) -> dict[str, Any]:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "?"

    with psycopg.connect(args.database_url, autocommit=True) as connection:
        row = connection.execute("SHOW server_version").fetchone()
    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "postgres_server": str(row[0]) if row else "?",
        "packages": {name: version(name) for name in PACKAGES},
        "operations": args.operations,
        "runs": args.runs,
        "latency": {
            "rate_per_s": args.rate,
            "drain_shares": None if args.rate else list(DRAIN_SHARES),
            "seconds": args.seconds,
            "writers": args.writers,
            "late_tolerance_ms": LATE_TOLERANCE_S * 1000,
            "kept_rate_share": KEPT_RATE_SHARE,
        },
        "cpu_groups": {
            "writer": "the latency writer processes, over their schedule (no writer in the "
            "drain window: the backlog is inserted before it)",
            "dispatcher": "effect-outbox's dispatcher processes; the minimal relay",
            "consumers": "effect-outbox's consumer processes; the minimal consumer; "
            "the pgqueuer and procrastinate worker",
            "postgres": bench.postgres.describe(),
            "rabbitmq": bench.rabbitmq.describe()
            + " (effect-outbox and the minimal pipeline only: the peers do not use it)",
            "unseen": "a group none of whose processes this machine shows (a server "
            "elsewhere) is left out of cpu_seconds and listed in unseen_groups",
            "counted": "utime+stime of each root, its alive descendants and the children "
            "they reaped (cutime+cstime), from /proc/<pid>/stat",
            "clock_ticks_per_s": CLOCK_TICKS,
        },
        "outbox_settings": outbox.as_dict(),
        "scale_out": (
            {
                "consumer_processes": args.scale_consumers,
                "dispatcher_processes": args.scale_dispatchers,
            }
            if args.scale_out
            else None
        ),
        "minimal": {"relay_batch": MINIMAL_BATCH, "consumer_prefetch": MINIMAL_PREFETCH},
        "pgqueuer": {"driver": "asyncpg", "batch_size": 10, "handler_pool": 10},
        "procrastinate": {
            "connector": "psycopg",
            "concurrency": bench.context.procrastinate_concurrency,
        },
    }


# --- entry ---------------------------------------------------------------------------


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


def scale_out_table(points: Sequence[dict[str, Any]]) -> str:
    groups = [group for group in CPU_GROUPS if group != "writer"]
    header = (
        "consumers",
        "dispatchers",
        "operations/s, median (runs)",
        "CPU ms/op",
        *groups,
        "cores busy",
    )
    lines: list[tuple[str, ...]] = [header]
    for point in points:
        runs = ", ".join(f"{run['per_s']:,.0f}" for run in point["throughput"])
        rate = f"{point['per_s_median']:,.0f} ({runs})" if point["throughput"] else "-"
        median = point["cpu_median_run"]
        budget = point["throughput"][median]["cpu"] if median is not None else None
        per_op = budget["cpu_ms_per_op"] if budget else {}
        lines.append(
            (
                str(point["consumers"]),
                str(point["dispatchers"]),
                rate,
                ms(per_op.get(TOTAL)),
                *(ms(per_op.get(group)) for group in groups),
                f"{budget['cores_busy']:.2f}" if budget else "-",
            )
        )
    return "\n".join(
        [
            "effect-outbox drain, scaled out (CPU: /proc utime+stime, the median run by total)",
            *columns(lines, left={2}),
        ]
    )


if __name__ == "__main__":
    main()
