"""The bench's systems on one protocol (bench/systems/): every system the comparison
names is there, its daemons fall in the CPU groups the report knows, and its children
run as ``python -m bench.e2e`` under the parent's names (no script paths, no sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from bench.e2e_processes import CPU_GROUPS
from bench.e2e_report import latency_line, phase_name
from bench.systems import CHILD_MODULE, SYSTEM_NAMES, Context, OutboxSettings, systems
from outbox.settings import Settings

CONTEXT = Context(
    admin_url="postgresql://postgres@127.0.0.1:5432/postgres",
    amqp_url="amqp://guest:guest@127.0.0.1:5672/",
    run_name="r1",
)
URL = "postgresql://postgres@127.0.0.1:5432/e2e_r1_x"


def test_every_system_the_comparison_names_is_one_class_each() -> None:
    found = systems(CONTEXT)
    assert tuple(found) == SYSTEM_NAMES
    assert {name: system.name for name, system in found.items()} == {n: n for n in SYSTEM_NAMES}
    assert len({type(system) for system in found.values()}) == len(SYSTEM_NAMES)


@pytest.mark.parametrize("name", SYSTEM_NAMES)
def test_daemons_fall_in_the_reports_cpu_groups(name: str) -> None:
    stages = systems(CONTEXT)[name].daemons(URL)
    groups = {daemon.group for stage in stages for daemon in stage}
    assert groups
    assert groups <= set(CPU_GROUPS) - {"writer"}
    # The consumers are ready before anything that feeds them starts.
    assert {daemon.group for daemon in stages[0]} == {"consumers"}


@pytest.mark.parametrize("name", ["minimal", "pgqueuer", "procrastinate"])
def test_children_run_as_the_bench_module_with_the_parents_names(name: str) -> None:
    for stage in systems(CONTEXT)[name].daemons(URL):
        for daemon in stage:
            assert daemon.argv[:3] == [sys.executable, "-m", CHILD_MODULE]
            child = daemon.argv[daemon.argv.index("--child") + 1]
            assert child.startswith(f"{name}-")
            assert daemon.argv[daemon.argv.index("--child-run") + 1] == CONTEXT.run_name


def test_only_the_broker_systems_count_rabbitmq() -> None:
    using = {name for name, system in systems(CONTEXT).items() if system.uses_broker}
    assert using == {"minimal", "outbox", "outbox-single", "outbox-in-transaction"}


def test_the_outbox_runs_the_product_defaults_and_the_single_one_message_each() -> None:
    defaults = Settings()
    found = systems(CONTEXT)
    chunked, one = (
        found[name].daemons(URL)[1][0].environment for name in ("outbox", "outbox-single")
    )
    assert chunked["OUTBOX_MESSAGE_OPERATIONS"] == str(defaults.message_operations)
    assert chunked["OUTBOX_PREFETCH"] == str(defaults.prefetch)
    assert one["OUTBOX_MESSAGE_OPERATIONS"] == "1"
    # Names of its own: the two never share a database or a queue.
    assert one["OUTBOX_QUEUE"] == f"bench.e2e.{CONTEXT.run_name}.outbox-single.q"
    told = systems(CONTEXT, OutboxSettings(chunk_operations=12, prefetch=64))["outbox"]
    environment = told.daemons(URL)[1][0].environment
    assert environment["OUTBOX_MESSAGE_OPERATIONS"] == "12"
    assert environment["OUTBOX_PREFETCH"] == "64"


def test_the_in_transaction_outbox_runs_the_same_daemons_on_names_of_its_own() -> None:
    found = systems(CONTEXT)
    own, in_transaction = (
        found[name].daemons(URL)[1][0].environment for name in ("outbox", "outbox-in-transaction")
    )
    assert in_transaction["OUTBOX_MESSAGE_OPERATIONS"] == own["OUTBOX_MESSAGE_OPERATIONS"]
    assert in_transaction["OUTBOX_QUEUE"] == (
        f"bench.e2e.{CONTEXT.run_name}.outbox-in-transaction.q"
    )


def test_outbox_daemons_follow_its_settings() -> None:
    settings = OutboxSettings(consumers=3, dispatchers=2)
    stages = systems(CONTEXT, settings)["outbox"].daemons(URL)
    assert [len(stage) for stage in stages] == [3, 2]
    environment = stages[0][0].environment
    assert environment["OUTBOX_TOOLS"] == "bench.e2e_tools"
    assert environment["OUTBOX_QUEUE"] == f"bench.e2e.{CONTEXT.run_name}.outbox.q"


def test_latency_points_are_named_by_their_share_of_the_drain() -> None:
    assert phase_name({"drain_share": 0.8, "offered_per_s": 1226.0}) == "@80% drain"
    assert phase_name({"drain_share": None, "offered_per_s": 500.0}) == "@500/s"


def test_latency_points_at_a_share_of_the_sustained_rate_say_so() -> None:
    point = {"share_of": "sustained", "drain_share": 0.5, "offered_per_s": 600.0}
    assert phase_name(point) == "@50% sustained"


def test_no_bench_module_but_the_replication_one_edits_sys_path() -> None:
    bench = Path(__file__).resolve().parents[2] / "bench"
    editing = sorted(path.name for path in bench.glob("*.py") if "sys.path" in path.read_text())
    # bench/replication.py needs tests/support's private servers, which import each
    # other as `support.*`: it stays a script beside the test suite.
    assert editing == ["replication.py"]


def measured(offered: float, achieved: float, late: int) -> dict[str, Any]:
    return {
        "offered_per_s": offered,
        "achieved_per_s": achieved,
        "writer_late": {"tolerance_ms": 10.0, "decisions": 1000, "late": late, "worst_ms": 1.0},
        "decision_to_effect_ms": {"p50": 4.25, "p99": 12.5, "max": 20.0},
        "effects": 1000,
        "decisions": 1000,
    }


def test_a_latency_line_gives_the_rates_and_the_late_share() -> None:
    line = latency_line(measured(offered=800, achieved=799, late=5))
    assert line == (
        "4.2 / 12.5 / 20.0 ms @800/s (offered 800/s, achieved 799/s, "
        "late 0.5% (> 10 ms behind schedule); 1,000/1,000 effects)"
    )


def test_a_latency_line_that_fell_behind_does_not_claim_the_rate() -> None:
    line = latency_line(measured(offered=500, achieved=153, late=999))
    assert "@500/s" not in line
    assert line.startswith("4.2 / 12.5 / 20.0 ms FELL BEHIND: 153/s of 500/s offered")
