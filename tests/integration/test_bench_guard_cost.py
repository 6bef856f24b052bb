"""bench/guard_cost.py against the real Postgres: each piece it names switches that guard
off and nothing else, the loop takes an operation through its four stages and counts
the backend's CPU of each, a measurement leaves no database behind, and a piece it does
not know is refused before any database is made."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import psycopg
import pytest

from bench import guard_cost
from outbox.sandbox.scratch import ScratchDatabase, new_tag

from support.db_helpers import execute_admin

ENABLED_TRIGGERS = """
SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
WHERE NOT t.tgisinternal AND t.tgenabled <> 'D'
  AND c.relname IN ('operations', 'operation_events', 'operation_event_heads', 'outbox')
"""
CONSTRAINTS = """
SELECT k.conname FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
WHERE c.relname IN ('operations', 'operation_events', 'operation_event_heads', 'outbox')
  AND k.contype IN ('c', 'f')
"""
TAGGED_DATABASES = "SELECT count(*) FROM pg_database WHERE datname LIKE %s"


@pytest.fixture
def scratch(postgres_server_url: str) -> Iterator[str]:
    with ScratchDatabase.unique(postgres_server_url, "guard_cost_test") as database:
        yield database.url


def names(url: str, sql: str) -> set[str]:
    return {row[0] for row in execute_admin(url, sql)}


@pytest.mark.parametrize("piece", sorted(set(guard_cost.PIECES) - {"none"}))
def test_each_piece_switches_off_what_it_names_and_nothing_else(scratch: str, piece: str) -> None:
    triggers, constraints = names(scratch, ENABLED_TRIGGERS), names(scratch, CONSTRAINTS)

    with psycopg.connect(scratch, autocommit=True) as admin:
        guard_cost.strip_piece(admin, piece)

    gone = (triggers - names(scratch, ENABLED_TRIGGERS)) | (
        constraints - names(scratch, CONSTRAINTS)
    )
    named = {
        statement.split()[-1]
        for statement in guard_cost.PIECES[piece]
        if "TRIGGER" in statement or "CONSTRAINT" in statement
    }
    assert gone == named
    assert gone


def test_the_loop_takes_each_operation_to_committed_and_counts_every_stage(
    scratch: str,
) -> None:
    with psycopg.connect(scratch, autocommit=True, row_factory=psycopg.rows.dict_row) as c:
        loop = guard_cost.OperationLoop(c)
        per_operation = loop.block(3)

    assert set(per_operation) == {*guard_cost.STAGES, "total"}
    assert all(spent > 0 for spent in per_operation.values())
    assert per_operation["total"] == pytest.approx(
        sum(per_operation[stage] for stage in guard_cost.STAGES)
    )
    states = execute_admin(scratch, "SELECT state, count(*) FROM operations GROUP BY state")
    assert states == [("committed", 3)]
    assert execute_admin(scratch, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == [
        (0,)
    ]


def test_without_the_chain_the_events_go_unchained(scratch: str) -> None:
    with psycopg.connect(scratch, autocommit=True) as admin:
        guard_cost.strip_piece(admin, "chain")
    with psycopg.connect(scratch, autocommit=True, row_factory=psycopg.rows.dict_row) as c:
        guard_cost.OperationLoop(c).block(1)

    assert execute_admin(scratch, "SELECT count(*), count(hash) FROM operation_events") == [(3, 0)]


def test_a_measurement_pairs_every_block_and_drops_its_databases(
    postgres_server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = f"t{new_tag()}"
    monkeypatch.setattr(guard_cost, "new_tag", lambda: tag)
    made: list[list[tuple[int]]] = []
    block = guard_cost.OperationLoop.block

    def block_counting_databases(loop: guard_cost.OperationLoop, size: int) -> dict[str, float]:
        made.append(execute_admin(postgres_server_url, TAGGED_DATABASES, (f"%\\_{tag}",)))
        return block(loop, size)

    monkeypatch.setattr(guard_cost.OperationLoop, "block", block_counting_databases)

    cost = guard_cost.measure_piece(postgres_server_url, "by-role", block=2, blocks=3)

    assert made[0] == [(2,)]  # the defaults' database and the variant's
    assert len(cost.defaults) == len(cost.stripped) == 3
    assert all(len(values) == 3 for values in cost.differences.values())
    assert cost.differences["total"] == pytest.approx(
        [without - on for without, on in zip(cost.stripped, cost.defaults, strict=True)]
    )
    assert "by-role" in cost.line()
    assert "of 3 blocks" in cost.line()
    assert execute_admin(postgres_server_url, TAGGED_DATABASES, (f"%\\_{tag}",)) == [(0,)]


def test_an_unknown_piece_is_refused_before_any_database_is_made(
    postgres_server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = f"t{new_tag()}"
    monkeypatch.setattr(guard_cost, "new_tag", lambda: tag)
    monkeypatch.setattr(
        sys,
        "argv",
        ["guard_cost", "--database-url", postgres_server_url, "--pieces", "chain", "cheques"],
    )

    with pytest.raises(SystemExit, match=r"unknown piece.*cheques"):
        guard_cost.main()

    assert execute_admin(postgres_server_url, TAGGED_DATABASES, (f"%\\_{tag}",)) == [(0,)]


def test_the_backend_cpu_is_read_for_the_server_process(scratch: str) -> None:
    with psycopg.connect(scratch, autocommit=True) as c:
        pid = c.info.backend_pid
        first = guard_cost.backend_cpu_ns(pid)
        c.execute("SELECT count(*) FROM generate_series(1, 200000)")
        assert guard_cost.backend_cpu_ns(pid) > first
