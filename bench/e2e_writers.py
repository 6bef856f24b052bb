"""bench/e2e.py's writer processes: each commits its share of one open-loop schedule (or
as many decisions as it can), started together once all are connected."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.cpu import cpu_seconds
from bench.e2e_processes import REPOSITORY
from bench.latency import Lateness, Pace, achieved_rate, due_at, scheduled
from bench.systems import READY, System, ready_marker

MODULE = "bench.e2e"
# The schedule starts this long after the last writer said it was ready (connected), so
# that no writer's start-up eats into it.
WRITER_LEAD_SECONDS = 0.2


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
