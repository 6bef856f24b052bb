"""The reconciler's scan for due work (``claim_reconciliation_batch``) against what a
busy database holds between two vacuums: a dead ``in_flight`` entry in
``operations_state_next_attempt`` for every operation settled since the last one.

A bitmap scan of that index visits the heap page of every entry, dead or alive, on
every pass, and never marks one dead: its cost grows with the operations settled since
the last vacuum, a share of the history under autovacuum's default trigger
(docs/benchmarks.md, "Cost as the history grows"). Ordered index scans mark each dead
entry once and pass over it from then on. On a table this small the dead versions
share a few heap pages, so what is checked is the plan's shape, not the pages read: no
bitmap scan, and the expired lease found on every pass."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg

from outbox import Registry, record_decision, store
from outbox.sql import QUERIES
from outbox.store import Store

SETTLED = 300
# In flight under a lease that runs on: work the scan passes over, as a busy system has.
HELD = 60


def _plan(connection: psycopg.Connection[Any]) -> str:
    with connection.transaction(force_rollback=True):
        return "\n".join(
            str(row[0])
            for row in connection.execute(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) "
                + QUERIES["claim_reconciliation_batch"].sql,
                {"limit": 100},
            )
        )


def test_the_due_scan_passes_over_dead_entries_of_settled_operations(
    database_url: str, registry: Registry
) -> None:
    with psycopg.connect(database_url) as connection:
        runner = Store(connection)
        ids = [
            record_decision(
                connection,
                registry,
                "send_refund",
                {"payment_id": f"pay_scan_{n}", "amount_cents": 100},
                run_id="scan",
                decision_key=str(n),
            ).operation.id
            for n in range(SETTLED + 1 + HELD)
        ]
        connection.commit()
        # Settled since the last vacuum: claimed, then committed, each in its own
        # transaction, as a consumer does; one more claimed under a lease already over.
        for operation_id in ids[:SETTLED]:
            (claimed,) = runner.run(
                store.claim_many([(operation_id, timedelta(minutes=5))], owner="w")
            ).values()
            connection.commit()
            effect = store.ConfirmedEffect(
                operation=claimed, provider_reference="re_scan", result={}, attributes={}
            )
            runner.run(store.commit_many([effect]))
            connection.commit()
        runner.run(store.claim_many([(ids[SETTLED], timedelta(microseconds=1))], owner="w"))
        runner.run(
            store.claim_many([(i, timedelta(hours=1)) for i in ids[SETTLED + 1 :]], owner="w")
        )
        connection.commit()
        connection.execute("ANALYZE operations")
        connection.commit()

        first = _plan(connection)
        second = _plan(connection)

    for plan in (first, second):
        assert "Bitmap Heap Scan on operations" not in plan, plan
        assert "Index Scan using operations_state_next_attempt" in plan, plan
    # The expired lease is found, every time.
    assert "CTE Scan on due (actual rows=1 loops=1)" in first, first
    assert "CTE Scan on due (actual rows=1 loops=1)" in second, second
