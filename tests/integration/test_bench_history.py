"""``bench.history_scale`` at a tiny size, against the real Postgres: the fill writes a
history the project's own checks accept (every chain verifies, the states and rows in
the proportions it states), and the runner times every named operation."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import psycopg
import pytest

from bench.history_fill import PROFILES, expected_states, fill, filled_ids, profile_of
from bench.history_live import start_live_workload
from bench.history_scale import compare, measure_both
from outbox.sandbox.scratch import ScratchDatabase
from outbox.store import Store, verify_chain

OPERATIONS = 200


def _count(url: str, sql: str, params: Mapping[str, object]) -> int:
    with psycopg.connect(url) as connection:
        row = connection.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


def test_the_fill_writes_settled_operations_whose_chains_verify(database_url: str) -> None:
    # Batches of 64: the last is short, and ids drawn per batch must not collide.
    report = fill(database_url, OPERATIONS, batch=64)
    runs = {"runs": f"run_{report.tag}_%"}

    ids = filled_ids(database_url, report.tag)
    assert len(ids) == OPERATIONS
    with psycopg.connect(database_url) as connection:
        states: dict[str, int] = dict(
            connection.execute(
                "SELECT state, count(*) FROM operations WHERE run_id LIKE %(runs)s GROUP BY 1",
                runs,
            ).fetchall()
        )
        runner = Store(connection)
        reports = [runner.run(verify_chain(operation_id)) for operation_id in ids]
    assert states == expected_states(OPERATIONS)
    assert [r.broken for r in reports if not r.intact] == []
    assert all(r.operations_checked == 1 for r in reports)
    # Every profile's events, each operation's head, and the approvals and callbacks rows
    # of the profiles that have them.
    shares = {name: 0 for name, *_ in PROFILES}
    for index in range(1, OPERATIONS + 1):
        shares[PROFILES[profile_of(index)][0]] += 1
    events = sum(shares[name] * len(names) for name, _, _, names in PROFILES)
    assert sum(r.events_checked for r in reports) == events
    assert (
        _count(
            database_url,
            "SELECT count(*) FROM operation_event_heads h JOIN operations o "
            "ON o.id = h.operation_id WHERE o.run_id LIKE %(runs)s",
            runs,
        )
        == OPERATIONS
    )
    assert (
        _count(
            database_url,
            "SELECT count(*) FROM approvals a JOIN operations o ON o.id = a.operation_id "
            "WHERE o.run_id LIKE %(runs)s",
            runs,
        )
        == shares["approved"]
    )
    assert (
        _count(
            database_url,
            "SELECT count(*) FROM callbacks c JOIN operations o ON o.id = c.operation_id "
            "WHERE o.run_id LIKE %(runs)s AND c.outcome = 'settled'",
            runs,
        )
        == shares["callback"]
    )


def test_a_fill_of_nothing_is_refused_and_writes_nothing(database_url: str) -> None:
    with pytest.raises(ValueError, match="at least one operation"):
        fill(database_url, 0)
    with pytest.raises(ValueError, match="at least one per batch"):
        fill(database_url, 10, batch=0)
    assert _count(database_url, "SELECT count(*) FROM operations", {}) == 0


@pytest.fixture
def second_database_url(postgres_server_url: str, template_database: str) -> Iterator[str]:
    with ScratchDatabase.unique(
        postgres_server_url, "outbox_test_history", template=template_database
    ) as database:
        yield database.url


def test_the_runner_times_every_named_operation(
    database_url: str, second_database_url: str, amqp_server_url: str
) -> None:
    # Two databases, as the bench has: each call runs against its own.
    fill(database_url, 50)
    live = start_live_workload(database_url)
    empty_live = start_live_workload(second_database_url)
    empty, full = measure_both(
        (second_database_url, empty_live), (database_url, live), calls=1, amqp_url=amqp_server_url
    )
    rows = compare(empty, full)
    assert [row["operation"] for row in rows] == [
        "record_decision",
        "dispatcher: claim + mark published",
        "dispatcher: gauges",
        "consumer: claim",
        "consumer: outcome (commit)",
        "reconciler: escalate_undeliverable",
        "reconciler: requeue_stale_prepared",
        "reconciler: reject_denied_operations",
        "reconciler: claim_callback_batch",
        "reconciler: chain_agent_reports",
        "reconciler: claim_reconciliation_batch",
        "reconciler: execution_gauges",
        "reconciler: waiting_operations_by_tool",
        "reconciler: pass",
        "console: overview",
        "console: escalations",
        "console: operation page",
        "console: a rare tool's operations",
        "console: a rare tool's committed",
        "ops list",
        "ops list --tool (a rare tool)",
        "ops verify OP",
        "ops verify: a run",
        "await_outcome",
    ]
    assert all(row["empty"]["median_ms"] > 0 and row["full"]["median_ms"] > 0 for row in rows)
    # Whatever the calls wrote was rolled back: the live workload is as it was.
    for url in (database_url, second_database_url):
        assert (
            _count(url, "SELECT count(*) FROM operations WHERE run_id = 'bench_history'", {}) == 0
        )
    # The plans behind each row a grown figure would show can be read.
    for row in rows:
        assert isinstance(live.explain(database_url, row["operation"]), str)
