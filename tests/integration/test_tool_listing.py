"""Lists filtered by a tool (the console's ``/operations?tool=T``, ``outbox ops list
--tool T``): read in branches, each settled state from ``operations_tool_settled`` and
the open states from ``operations_state_next_attempt``, so a tool with few operations
or none reads a page at most, not the table (issue #48). The rows are those the
filters select, in the order the lists without a tool give them, whichever branches
the filter asks for.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import psycopg
import pytest

from bench.history_fill import fill
from outbox import OperationState, Registry
from outbox import store as outbox_store
from outbox.sql import QUERIES
from outbox.store import Cursor, OperationFilter, Store
from outbox.store.operator import tool_listing_limits

from support.ops_helpers import Ops

S = OperationState
TOOLS = ("send_refund", "open_ticket", "no_such_tool")
STATE_FILTERS: tuple[tuple[OperationState, ...], ...] = (
    (),
    (S.COMMITTED,),
    (S.REJECTED,),
    (S.PREPARED,),
    (S.ESCALATED,),
    (S.COMMITTED, S.REJECTED),
    (S.IN_FLIGHT, S.COMMITTED),
    (S.PREPARED, S.IN_FLIGHT, S.OUTCOME_UNKNOWN, S.ESCALATED),
    tuple(S),
)


def _some_in_every_state(database_url: str, registry: Registry) -> None:
    ops = Ops(database_url, registry)
    for state in S:
        for tool, times in (("send_refund", 3), ("open_ticket", 1)):
            for _ in range(times):
                ops.at(state, tool=tool, run_id=f"listing_{tool}")
    with psycopg.connect(database_url) as connection:
        # Ties in the change time, as a batch's moves have (one transaction, one now()):
        # past the trigger that stamps updated_at, as a superuser.
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET updated_at = '2026-01-01T00:00:00Z'"
            " WHERE id IN (SELECT id FROM operations ORDER BY id LIMIT 9)"
        )


def _selections(
    database_url: str, registry: Registry
) -> Iterator[tuple[str, tuple[OperationState, ...], list[Any]]]:
    """Operations of two tools in every state, then each tool and state filter with
    every operation it selects as (updated_at, id), read from the table itself."""
    _some_in_every_state(database_url, registry)
    with psycopg.connect(database_url) as connection:
        for tool in TOOLS:
            for states in STATE_FILTERS:
                yield (
                    tool,
                    states,
                    connection.execute(
                        "SELECT updated_at, id FROM operations WHERE tool_name = %(tool)s"
                        " AND (%(states)s::text[] = '{}' OR state = ANY(%(states)s::text[]))",
                        {"tool": tool, "states": [str(s) for s in states]},
                    ).fetchall(),
                )


def _walk(database_url: str, where: OperationFilter) -> list[UUID]:
    seen: list[UUID] = []
    after: Cursor | None = None
    with psycopg.connect(database_url) as connection:
        while True:
            page = Store(connection).run(outbox_store.operations_page(where, after=after, limit=2))
            seen += [row.id for row in page.rows]
            if page.next is None:
                return seen
            after = page.next


def test_a_tool_s_pages_hold_what_the_filter_selects_newest_first(
    database_url: str, registry: Registry
) -> None:
    for tool, states, selected in _selections(database_url, registry):
        expected = [i for _, i in sorted(selected, reverse=True)]

        walked = _walk(database_url, OperationFilter(states=states, tool=tool))

        assert walked == expected, (tool, states)
    # Without a tool, the same walk as ever: every operation, newest first.
    assert len(_walk(database_url, OperationFilter())) == 4 * len(S)


def test_ops_list_of_a_tool_holds_what_the_filter_selects_in_its_order(
    database_url: str, registry: Registry
) -> None:
    ops = Ops(database_url, registry)
    for tool, states, selected in _selections(database_url, registry):
        # Newest change first and, within one change time, by id: ops list's order.
        by_id = sorted(selected, key=lambda row: row[1])
        expected = [i for _, i in sorted(by_id, key=lambda row: row[0], reverse=True)]
        for limit in (2, 50):
            listed = ops.run(
                outbox_store.list_operation_summaries(
                    states=list(states) or None, tool=tool, limit=limit
                )
            )

            assert [row.id for row in listed] == expected[:limit], (tool, states, limit)


QUERY_PARAMS = {
    "console_tool_operations_page": {"run_id": None, "until": None, "after_updated_at": None},
    "list_tool_operation_summaries": {"ago": None},
}


def test_a_rare_tool_s_list_reads_its_index_not_the_table(
    database_url: str, registry: Registry
) -> None:
    # A history of other tools' settled operations, and two of this one's among them.
    fill(database_url, 12_000, batch=12_000)
    ops = Ops(database_url, registry)
    ops.at(S.COMMITTED, tool="open_ticket")
    ops.at(S.REJECTED, tool="open_ticket")
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute("VACUUM ANALYZE operations")
        pages = connection.execute(
            "SELECT pg_relation_size('operations') / current_setting('block_size')::int"
        ).fetchone()
        plans = {
            (query, tool, str(states)): "\n".join(
                str(row[0])
                for row in connection.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) " + QUERIES[query].sql,
                    {
                        **params,
                        "states": [str(s) for s in states] if states else None,
                        "tool": tool,
                        "since": None,
                        "after_id": None,
                        "limit": 51,
                        **tool_listing_limits(states, 51),
                    },
                )
            )
            for query, params in QUERY_PARAMS.items()
            for tool in ("open_ticket", "no_such_tool")
            for states in (None, [S.COMMITTED], [S.REJECTED])
        }

    assert pages is not None
    assert pages[0] > 150  # so a scan of the table would read every one of them
    for case, plan in plans.items():
        assert "operations_tool_settled" in plan, case
        # Not even planned: a branch a filter leaves out is costed all the same, and a
        # scan of a large table in the plan's cost is enough to have it compiled (JIT).
        assert "Seq Scan" not in plan, (case, plan)
        assert "JIT" not in plan, (case, plan)
        buffers = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
        assert buffers is not None, (case, plan)
        assert int(buffers[1]) + int(buffers[2] or 0) < 40, (case, plan)


@pytest.mark.parametrize(
    ("states", "limits"),
    [
        (None, (51, 51, 51)),
        ([S.COMMITTED], (51, 0, 0)),
        ([S.REJECTED, S.PREPARED], (0, 51, 51)),
        ([S.ESCALATED], (0, 0, 51)),
        (list(S), (51, 51, 51)),
    ],
)
def test_only_the_branches_a_filter_asks_for_are_read(
    states: list[OperationState] | None, limits: tuple[int, ...]
) -> None:
    got = tool_listing_limits(states, 51)

    assert (got["committed_limit"], got["rejected_limit"], got["open_limit"]) == limits
