"""bench/e2e.py's measured phases: a drain of a backlog, writers flat out (the sustained
rate), writers on a schedule (latency); a phase that dies is a failure, not the end."""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from bench.e2e_processes import Bench, cpu_budget, wait_for_effects
from bench.e2e_writers import run_writers
from bench.latency import Pace, sustained_rate
from bench.reporting import percentile
from bench.systems import System
from outbox.sandbox.processes import DaemonProcess

T = TypeVar("T")
# After the writers stop, how long effects may still take.
SETTLE_SECONDS = 60.0


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


def run_phase(name: str, failures: list[str], phase: Callable[[], T]) -> T | None:
    """One phase; one that dies (the broker restarted under it, say) is a failure and
    the phases after it still run."""
    try:
        return phase()
    except Exception as error:
        failures.append(f"{name}: aborted by {type(error).__name__}: {error}")
        print(f"FAILED: {failures[-1]}", flush=True)
        return None
