"""The archive's batches on a backlog (schema version 15, docs/design.md section 15, "A
batch's locks"): a batch holds two advisory locks for each operation it takes and no
more, whatever plan the planner picks, on tables never analyzed too; what another
session holds is passed over; a backlog of thousands leaves whole, a batch at a time.

Versions 13 and 14 tried the locks in the candidate query's WHERE: when the plan
sorted, it locked every eligible operation before the LIMIT, and a first archive of
18,445 operations failed with "out of shared memory". The backlog is written by the
history benchmark's fill (bench/history_fill.py), with autovacuum off on its tables so
that nothing analyzes them meanwhile."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from datetime import timedelta
from uuid import UUID

import psycopg
import pytest

from bench.history_fill import FILLED_TABLES, fill
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.store import Store

from support.db_helpers import execute_admin

BACKLOG = 3_000
# How many of the backlog are older than the hot window the tests use.
ELIGIBLE = 2_600
# The plan version 14's candidate query got on these tables unanalyzed, forced: with
# no index to walk, it scanned and sorted every eligible operation.
NO_INDEX = ("SET LOCAL enable_indexscan = off", "SET LOCAL enable_bitmapscan = off")
REPORT_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('outbox.agent_reports:' || %s, 0))"
CALLBACK_LOCK = "SELECT pg_advisory_xact_lock_shared(outbox_callback_lock_key(%s))"


@pytest.fixture
def backlog(database_url: str) -> Iterator[timedelta]:
    """BACKLOG settled operations, quiet, never analyzed, over 90 days; the hot window
    that leaves exactly the ELIGIBLE oldest past it (its edge halfway between two
    operations, 43 minutes apart)."""
    for table in FILLED_TABLES:
        execute_admin(database_url, f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    fill(database_url, BACKLOG)
    rows = execute_admin(
        database_url,
        "SELECT now() - (a + (b - a) / 2) FROM (SELECT "
        "(SELECT updated_at FROM operations ORDER BY updated_at, id OFFSET %s LIMIT 1),"
        " (SELECT updated_at FROM operations ORDER BY updated_at, id OFFSET %s LIMIT 1)"
        ") AS edge (a, b)",
        (ELIGIBLE - 1, ELIGIBLE),
    )
    yield rows[0][0]
    # The premise held: nothing analyzed the tables while the test ran.
    assert execute_admin(
        database_url,
        "SELECT last_analyze, last_autoanalyze FROM pg_stat_user_tables "
        "WHERE relname = 'operations'",
    ) == [(None, None)]


def oldest(database_url: str, count: int) -> list[UUID]:
    rows = execute_admin(
        database_url, "SELECT id FROM operations ORDER BY updated_at, id LIMIT %s", (count,)
    )
    return [row[0] for row in rows]


def in_history(database_url: str) -> set[UUID]:
    return {row[0] for row in execute_admin(database_url, "SELECT operation_id FROM history")}


def one_batch(
    database_url: str, hot: timedelta, batch: int, settings: tuple[str, ...] = ()
) -> tuple[int, int]:
    """One batch, as the archive command runs it: how many operations it moved, and how
    many advisory locks its transaction held just before it committed."""
    with psycopg.connect(database_url) as mover:
        for setting in settings:
            mover.execute(setting)
        checkpoints = Store(mover).run(outbox_store.archive_batch(hot, batch))
        row = mover.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return sum(checkpoint.operations for checkpoint in checkpoints), int(row[0])


@pytest.mark.parametrize(
    ("plan", "batch", "moves"),
    [("as planned", 100, 100), ("no index", 100, 100), ("no index", 5_000, 1_000)],
)
def test_a_batch_locks_only_what_it_moves_whatever_the_plan(
    database_url: str, backlog: timedelta, plan: str, batch: int, moves: int
) -> None:
    expected = oldest(database_url, moves)

    moved, held = one_batch(database_url, backlog, batch, NO_INDEX if plan == "no index" else ())

    assert moved == moves  # a batch asked for more than 1,000 moves 1,000
    assert held == 2 * moves
    assert in_history(database_url) == set(expected)


def test_what_another_session_holds_is_passed_over_at_no_lock_cost(
    database_url: str, backlog: timedelta
) -> None:
    first = oldest(database_url, 20)
    # An agent's report being recorded on the first five (the lock the move tries
    # first), callbacks being recorded on the next five (the one it tries second).
    with psycopg.connect(database_url) as holder:
        for operation_id in first[:5]:
            holder.execute(REPORT_LOCK, (str(operation_id),))
        for operation_id in first[5:10]:
            holder.execute(CALLBACK_LOCK, (operation_id,))
        moved, held = one_batch(database_url, backlog, 10, NO_INDEX)
        while_held = in_history(database_url)
    moved_after, _ = one_batch(database_url, backlog, 10)

    assert (moved, held) == (10, 20)
    assert while_held == set(first[10:20])
    assert moved_after == 10
    assert in_history(database_url) == set(first)


def test_rows_another_session_locked_are_passed_over_within_the_batch(
    database_url: str, backlog: timedelta
) -> None:
    first = oldest(database_url, 13)
    with psycopg.connect(database_url) as holder:
        holder.execute("SELECT 1 FROM operations WHERE id = ANY(%s) FOR UPDATE", (first[:3],))
        moved, held = one_batch(database_url, backlog, 10)
        while_held = in_history(database_url)
    moved_after, _ = one_batch(database_url, backlog, 6)

    # The three it locked and could not take count against the batch: their advisory
    # locks are held to the commit all the same.
    assert (moved, held) == (7, 20)
    assert while_held == set(first[3:10])
    assert moved_after == 6
    assert in_history(database_url) == set(first)


def test_an_unanalyzed_backlog_leaves_whole_a_batch_at_a_time(
    database_url: str,
    backlog: timedelta,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    eligible = oldest(database_url, ELIGIBLE)
    hot = f"{int(backlog.total_seconds())}s"

    code = run_command(["history", "archive", "--hot", hot, "--batch", "500"])
    out = capsys.readouterr().out

    assert code == 0, out
    batches = math.ceil(ELIGIBLE / 500)
    assert re.search(rf"moved {ELIGIBLE} settled operation\(s\) .* in {batches} batch\(es\)", out)
    assert in_history(database_url) == set(eligible)
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == [(BACKLOG - ELIGIBLE,)]
    assert execute_admin(
        database_url, "SELECT sum(operations) FROM history_checkpoints WHERE kind = 'archived'"
    ) == [(ELIGIBLE,)]


def test_a_batch_over_a_thousand_is_refused_by_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_command(["history", "archive", "--batch", "1001"])

    assert exit_info.value.code == 2
    assert "--batch: must be between 1 and 1000" in capsys.readouterr().err


def test_migrating_a_version_14_database_replaces_the_move_and_keeps_its_grants(
    database_url: str, backlog: timedelta
) -> None:
    with psycopg.connect(database_url) as connection:
        outbox_schema.apply_roles(connection)
    # As a version 14 database looks: another schema.sql applied, no version 15, no
    # outbox_history_quiet, and a move of its own (a stand-in that moves nothing),
    # executable by the operators.
    execute_admin(
        database_url,
        "CREATE OR REPLACE FUNCTION outbox_history_archive(p_hot interval, p_batch integer) "
        "RETURNS TABLE (settled_on date, operations integer, events bigint, digest text) "
        "LANGUAGE sql AS $$ SELECT NULL::date, 0, 0::bigint, NULL::text WHERE false $$;"
        "DROP FUNCTION outbox_history_quiet(uuid);"
        "UPDATE outbox_schema_applied SET digest = repeat('0', 64);"
        "DELETE FROM outbox_schema_version WHERE version = 15",
    )
    before = one_batch(database_url, backlog, 100)
    with psycopg.connect(database_url) as connection:
        told_to_migrate = not outbox_schema.schema_is_current(connection)

    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
        assert outbox_schema.schema_is_current(connection)
    after = one_batch(database_url, backlog, 100)

    assert told_to_migrate

    assert before == (0, 0)
    assert after == (100, 200)
    assert execute_admin(
        database_url,
        "SELECT has_function_privilege('outbox_operator', "
        "'outbox_history_archive(interval, integer)', 'EXECUTE'), "
        "has_function_privilege('outbox_agent', "
        "'outbox_history_archive(interval, integer)', 'EXECUTE')",
    ) == [(True, False)]
