"""The counts of ``outbox stats`` and the console's overview, against the real Postgres:
the open states are always counted exactly; committed and rejected exactly on a small
table and, past the threshold, estimated from a sample of the table's pages, so the
statement costs what is open plus a bounded sample, not the history (issue #48)."""

from __future__ import annotations

from typing import Any

import psycopg

from bench.history_fill import fill
from outbox import OperationState, Registry
from outbox import store as outbox_store
from outbox.sql import QUERIES
from outbox.store import OperationStats, Store

from support.ops_helpers import Ops

S = OperationState
SETTLED = frozenset((S.COMMITTED, S.REJECTED))


def _stats(database_url: str, **limits: int) -> OperationStats:
    with psycopg.connect(database_url) as connection:
        return Store(connection).run(outbox_store.operation_stats(**limits))


def _exact(database_url: str) -> dict[str, dict[str, int]]:
    counted: dict[str, dict[str, int]] = {}
    with psycopg.connect(database_url) as connection:
        for tool, state, operations in connection.execute(
            "SELECT tool_name, state, count(*) FROM operations GROUP BY 1, 2"
        ):
            counted.setdefault(tool, {})[state] = operations
    return counted


def _analyze(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute("ANALYZE operations")


def _some_of_each(ops: Ops) -> None:
    for _ in range(4):
        ops.at(S.COMMITTED)
    for _ in range(2):
        ops.at(S.REJECTED)
    ops.at(S.ESCALATED)
    ops.at(S.OUTCOME_UNKNOWN)
    ops.at(S.ESCALATED, tool="open_ticket")
    ops.new()


def test_a_small_table_is_counted_exactly(database_url: str, registry: Registry) -> None:
    _some_of_each(Ops(database_url, registry))

    stats = _stats(database_url)

    assert stats.estimated == frozenset()
    assert stats.by_tool == _exact(database_url)


def test_past_the_threshold_the_open_states_are_counted_and_the_settled_estimated(
    database_url: str, registry: Registry
) -> None:
    # Forced with a threshold of 0. The estimate scales the sample's shares by the rows
    # the statistics count: none before the first ANALYZE, every one after it on a
    # table this small (ANALYZE reads it whole, and the sample is every page).
    ops = Ops(database_url, registry)
    _some_of_each(ops)
    exact = _exact(database_url)
    open_counts = {
        tool: {state: n for state, n in states.items() if S(state) not in SETTLED}
        for tool, states in exact.items()
    }

    before = _stats(database_url, exact_below=0)
    _analyze(database_url)
    after = _stats(database_url, exact_below=0)
    # Open operations that came after the statistics are counted all the same.
    ops.at(S.ESCALATED)
    ops.new(tool="open_ticket")
    later = _stats(database_url, exact_below=0)

    assert before.estimated == after.estimated == SETTLED
    assert before.by_tool == {
        "send_refund": {**open_counts["send_refund"], "committed": 0, "rejected": 0},
        "open_ticket": open_counts["open_ticket"],
    }
    assert after.by_tool == exact
    assert later.by_tool["send_refund"]["escalated"] == exact["send_refund"]["escalated"] + 1
    assert later.by_tool["open_ticket"] == {"escalated": 1, "prepared": 1}


def test_the_estimate_reads_a_sample_of_a_large_table_and_the_open_rows_from_their_index(
    database_url: str, registry: Registry
) -> None:
    fill(database_url, 3_000, batch=3_000)
    ops = Ops(database_url, registry)
    ops.at(S.ESCALATED)
    ops.new()
    _analyze(database_url)
    exact = _exact(database_url)
    with psycopg.connect(database_url) as connection:
        pages = connection.execute(
            "SELECT pg_relation_size('operations') / current_setting('block_size')::int"
        ).fetchone()
        connection.execute("SET enable_seqscan = off")
        plan = "\n".join(
            str(row[0])
            for row in connection.execute(
                "EXPLAIN (ANALYZE, FORMAT TEXT) "
                + QUERIES["estimate_operations_by_tool_and_state"].sql,
                {"sample_pages": 20},
            )
        )

    stats = _stats(database_url, exact_below=0, sample_pages=20)

    assert pages is not None
    assert pages[0] > 100  # so 20 pages are a fifth or less
    sampled = next(line for line in plan.splitlines() if "Sample Scan on operations" in line)
    assert int(sampled.split("rows=")[-1].split()[0]) < 3_000 // 4, plan
    assert "operations_state_next_attempt" in plan, plan
    assert stats.estimated == SETTLED
    assert stats.by_tool["send_refund"]["escalated"] == 1
    assert stats.by_tool["send_refund"]["prepared"] == 1

    def settled(counts: dict[str, dict[str, int]]) -> int:
        return sum(n for states in counts.values() for s, n in states.items() if S(s) in SETTLED)

    # A ratio of the sample times the table's rows: close on the whole, not exact.
    assert abs(settled(stats.by_tool) - settled(exact)) <= settled(exact) // 10
    assert settled(stats.by_tool) != 0


def test_the_estimate_is_never_compiled_by_jit(database_url: str, registry: Registry) -> None:
    fill(database_url, 3_000, batch=3_000)
    _analyze(database_url)
    estimate = "EXPLAIN (ANALYZE) " + QUERIES["estimate_operations_by_tool_and_state"].sql

    def plan(connection: psycopg.Connection[Any]) -> str:
        rows = connection.execute(estimate, {"sample_pages": 20}).fetchall()
        return "\n".join(str(row[0]) for row in rows)

    with psycopg.connect(database_url) as connection:
        # Every plan past no cost at all would be compiled, as a large table's is.
        connection.execute("SET jit_above_cost = 0")
        compiled = plan(connection)
        connection.rollback()
        connection.execute("SET jit_above_cost = 0")
        stats = Store(connection).run(outbox_store.operation_stats(exact_below=0, sample_pages=20))
        after_stats = plan(connection)

    assert "JIT:" in compiled, compiled  # what the statement costs without the step
    assert stats.estimated == SETTLED
    assert "JIT:" not in after_stats, after_stats
