"""bench/e2e.py's report: medians and ratios, the table on stdout, the CPU table, and the
environment recorded beside the figures in the JSON."""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

import psycopg

from bench.cpu import CLOCK_TICKS, TOTAL
from bench.e2e_processes import CPU_GROUPS, Bench
from bench.latency import DRAIN_SHARES, KEPT_RATE_SHARE, LATE_TOLERANCE_S, Lateness, Pace
from bench.systems import MINIMAL_BATCH, MINIMAL_PREFETCH, OutboxSettings

PACKAGES = ("aio-pika", "aiormq", "psycopg", "uvloop", "asyncpg", "pgqueuer", "procrastinate")


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
