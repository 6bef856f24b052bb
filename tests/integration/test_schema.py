from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Registry, record_decision
from outbox import schema as outbox_schema
from outbox.migrate import SchemaBusy, migrate
from outbox.sql import schema_sql

from support.db_helpers import execute_admin

SCHEMA_OBJECTS = """
SELECT (SELECT count(*) FROM pg_tables WHERE schemaname = 'public'),
       (SELECT count(*) FROM pg_indexes WHERE schemaname = 'public'),
       (SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal),
       (SELECT count(*) FROM outbox_schema_version)
"""


def test_applying_the_schema_again_is_harmless(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with engine.begin() as connection:
        record_decision(
            connection, registry, "send_refund", {"payment_id": "p", "amount_cents": 1}, run_id="r"
        )
    before = execute_admin(database_url, SCHEMA_OBJECTS)

    for _ in range(2):
        with psycopg.connect(database_url) as connection:
            assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION

    assert execute_admin(database_url, SCHEMA_OBJECTS) == before
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == [(1,)]


def test_schema_version_is_none_on_an_empty_database(empty_database_url: str) -> None:
    with psycopg.connect(empty_database_url) as connection:
        assert outbox_schema.schema_version(connection) is None
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
        assert outbox_schema.schema_version(connection) == outbox_schema.SCHEMA_VERSION


def test_a_database_without_version_4_is_told_to_migrate(database_url: str) -> None:
    # As a version-3 database looks: everything but operations.effect_possible (and
    # version 6's view, which reads that column).
    execute_admin(database_url, "DROP VIEW operation_status")
    execute_admin(database_url, "ALTER TABLE operations DROP COLUMN effect_possible")
    execute_admin(database_url, "DELETE FROM outbox_schema_version WHERE version = 4")
    with psycopg.connect(database_url) as connection:
        assert not outbox_schema.schema_is_current(connection)

    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
    with psycopg.connect(database_url) as connection:
        assert outbox_schema.schema_is_current(connection)


@pytest.mark.parametrize(
    "version_8",
    [
        "DROP TABLE provider_health",
        "DROP TABLE provider_calls",
        "ALTER TABLE operations DROP COLUMN waiting_since",
    ],
)
def test_a_database_without_version_9_is_told_to_migrate_and_migrates(
    database_url: str, version_8: str
) -> None:
    # As a version-8 database looks, one of version 9's objects at a time: a consumer on
    # it would fail every hold of a provider that is down, so it refuses to start.
    execute_admin(database_url, version_8)
    execute_admin(database_url, "DELETE FROM outbox_schema_version WHERE version = 9")
    with psycopg.connect(database_url) as connection:
        assert not outbox_schema.schema_is_current(connection)

    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
    with psycopg.connect(database_url) as connection:
        assert outbox_schema.schema_is_current(connection)


def test_a_version_7_database_loses_its_redundant_run_index(database_url: str) -> None:
    # As a version-7 database looks: it still has the index on run_id alone.
    execute_admin(database_url, "CREATE INDEX operations_run ON operations (run_id)")
    execute_admin(database_url, "DELETE FROM outbox_schema_version WHERE version = 8")
    execute_admin(database_url, "DROP TABLE outbox_schema_applied")  # new in version 10

    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION

    assert execute_admin(database_url, "SELECT to_regclass('operations_run')") == [(None,)]
    # What the run filter reads instead: the unique (run_id, decision_key) index.
    with psycopg.connect(database_url) as connection:
        connection.execute("SET enable_seqscan = off")
        plan = connection.execute("EXPLAIN SELECT id FROM operations WHERE run_id = 'r'")
        lines = " ".join(str(row[0]) for row in plan.fetchall())
    assert "operations_run_decision_key" in lines, lines


def test_an_operation_is_born_with_no_possible_effect(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with engine.begin() as connection:
        recorded = record_decision(
            connection, registry, "send_refund", {"payment_id": "p", "amount_cents": 1}, run_id="r"
        ).operation
    assert not recorded.effect_possible

    with pytest.raises(psycopg.errors.CheckViolation, match="must be prepared"):
        execute_admin(
            database_url,
            "INSERT INTO operations (id, run_id, tool_name, tool_version, side_effect, input,"
            " input_fingerprint, effect_possible)"
            " SELECT gen_random_uuid(), 'r2', tool_name, tool_version, side_effect, input,"
            " input_fingerprint, true FROM operations",
        )


def test_operation_events_are_append_only(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with engine.begin() as connection:
        record_decision(
            connection, registry, "send_refund", {"payment_id": "p", "amount_cents": 1}, run_id="r"
        )

    for statement in (
        "UPDATE operation_events SET name = 'operation.committed'",
        "DELETE FROM operation_events",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
            execute_admin(database_url, statement)
    assert execute_admin(database_url, "SELECT name FROM operation_events") == [
        ("operation.prepared",)
    ]


def test_a_committed_outbox_row_notifies_a_listener(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute("LISTEN outbox_pending")
        with engine.begin() as connection:
            record_decision(
                connection,
                registry,
                "send_refund",
                {"payment_id": "p", "amount_cents": 1},
                run_id="r",
            )
        notifications = list(listener.notifies(timeout=10, stop_after=1))

    assert [n.channel for n in notifications] == ["outbox_pending"]


def test_a_rolled_back_outbox_row_notifies_nobody(
    database_url: str, engine: sa.Engine, registry: Registry
) -> None:
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute("LISTEN outbox_pending")
        with engine.connect() as connection:
            record_decision(
                connection,
                registry,
                "send_refund",
                {"payment_id": "p", "amount_cents": 1},
                run_id="r",
            )
            connection.rollback()
        # A marker notification after the rollback bounds the wait without a sleep:
        # anything the rolled-back insert sent would arrive before it.
        execute_admin(database_url, "NOTIFY outbox_pending, 'marker'")
        notifications = list(listener.notifies(timeout=10, stop_after=1))

    assert [n.payload for n in notifications] == ["marker"]


def test_the_time_bound_is_inlined_into_its_callers(database_url: str) -> None:
    # The outbox and operations guards call outbox_plausible_time on every row they
    # check; a SQL function that is not inlined runs its own executor on each call.
    with psycopg.connect(database_url) as connection:
        plan = connection.execute(
            "EXPLAIN VERBOSE SELECT outbox_plausible_time(available_at) FROM outbox"
        ).fetchall()
    output = "\n".join(line for (line,) in plan)

    assert "outbox_plausible_time" not in output
    assert "clock_timestamp()" in output


def test_the_schema_text_is_the_repository_file() -> None:
    from pathlib import Path

    root_schema = Path(__file__).resolve().parents[2] / "schema.sql"
    assert schema_sql() == root_schema.read_text(encoding="utf-8")


@pytest.fixture
def open_transaction(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An analyst's psql: a transaction that read operations and stays open, holding
    its ACCESS SHARE lock until the test ends."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SELECT count(*) FROM operations").fetchone()
        yield connection
        connection.rollback()


def test_migrating_a_current_schema_again_locks_no_table(
    database_url: str, open_transaction: psycopg.Connection[Any]
) -> None:
    # One try of a fifth of a second: any statement that wanted a table's lock would end
    # the migration with SchemaBusy.
    report = migrate(database_url, lock_timeout=0.2, lock_tries=1)

    assert report.schema_version == outbox_schema.SCHEMA_VERSION
    assert open_transaction.execute("SELECT 1").fetchone() == (1,)


def test_a_schema_change_behind_an_open_transaction_gives_up_and_names_who_holds_it(
    database_url: str, open_transaction: psycopg.Connection[Any]
) -> None:
    # As a database migrated with an earlier schema.sql looks: its digest is not this one.
    execute_admin(database_url, "UPDATE outbox_schema_applied SET digest = repeat('0', 64)")
    holder = open_transaction.info.backend_pid

    with pytest.raises(SchemaBusy) as busy:
        migrate(database_url, lock_timeout=0.2, lock_tries=2)

    assert holder in [session.pid for session in busy.value.holders]
    assert f"pid {holder} (role postgres, idle in transaction, for " in str(busy.value)
    assert "Nothing was applied" in str(busy.value)
    # Nothing committed, and the tables never stayed locked: a new reader goes through.
    assert execute_admin(database_url, "SELECT digest FROM outbox_schema_applied") == [("0" * 64,)]
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == [(0,)]

    open_transaction.rollback()
    # The default waits: nothing holds a table now, but a busy machine's autovacuum may.
    migrate(database_url)
    (digest,) = execute_admin(database_url, "SELECT digest FROM outbox_schema_applied")[0]
    assert digest != "0" * 64


def test_a_version_9_database_pinned_to_its_schema_is_told_to_migrate_and_migrates(
    database_url: str,
) -> None:
    # Version 9 pinned every function to the schema itself, where a role that may
    # create there can define a better-fitting operator.
    execute_admin(
        database_url,
        "ALTER FUNCTION outbox_record_decision(uuid, text, text, text, integer, text, jsonb, "
        "text, boolean, jsonb, integer) SET search_path = public, pg_temp",
    )
    execute_admin(database_url, "DELETE FROM outbox_schema_version WHERE version = 10")
    execute_admin(database_url, "DROP TABLE outbox_schema_applied")
    with psycopg.connect(database_url) as connection:
        assert not outbox_schema.schema_is_current(connection)

    assert migrate(database_url).schema_version == outbox_schema.SCHEMA_VERSION

    with psycopg.connect(database_url) as connection:
        assert outbox_schema.schema_is_current(connection)
    assert execute_admin(
        database_url,
        "SELECT proconfig FROM pg_proc WHERE proname = 'outbox_record_decision'",
    ) == [(["lock_timeout=5s", "search_path=pg_catalog, pg_temp"],)]
