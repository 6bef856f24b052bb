"""The e2e bench's effect-outbox writers against the real Postgres: ``outbox`` records
each decision as a transaction of its own, ``outbox-in-transaction`` in a transaction
block; both leave the operation each call returned, committed, and nothing else."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from bench.systems import Context, OutboxSettings, System, systems
from bench.systems.effect_outbox import Outbox
from outbox.sandbox.scratch import new_tag

from support.db_helpers import Counts, committed_counts


async def write_three(system: System, url: str) -> list[str]:
    """Three decisions through the system's own writer; their operations' ids."""
    enqueue, close = await system.writer(url)
    try:
        return [await enqueue(n) for n in range(3)]
    finally:
        await close()


@pytest.fixture
def context(postgres_server_url: str, amqp_server_url: str) -> Context:
    return Context(
        admin_url=postgres_server_url, amqp_url=amqp_server_url, run_name=f"t{new_tag()}"
    )


@pytest.mark.parametrize("name", ["outbox", "outbox-in-transaction"])
def test_each_outbox_writer_commits_every_decision(context: Context, name: str) -> None:
    # Sync: setting a system up and tearing it down run event loops of their own.
    system = systems(context)[name]
    url = system.set_up()

    try:
        ids = asyncio.run(write_three(system, url))
        with psycopg.connect(url, autocommit=True) as check:
            stored = {
                str(row[0])
                for row in check.execute("SELECT id FROM operations WHERE state = 'prepared'")
            }
        assert stored == set(ids)
        assert committed_counts(url) == Counts(3, 3, 3)
    finally:
        system.tear_down()


ENABLED_TRIGGERS = """
SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
WHERE NOT t.tgisinternal AND t.tgenabled <> 'D'
  AND c.relname IN ('operations', 'operation_events', 'operation_event_heads', 'outbox')
"""
GUARD_CONSTRAINTS = """
SELECT count(*) FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
WHERE k.contype IN ('c', 'f')
  AND c.relname IN ('operations', 'operation_events', 'operation_event_heads', 'outbox')
"""


def stripped_outbox(context: Context, *strip: str) -> Outbox:
    return Outbox(context, OutboxSettings(strip=strip))


def test_an_outbox_stripped_of_everything_keeps_its_waking_triggers_and_still_records(
    context: Context,
) -> None:
    system = stripped_outbox(context, "chain", "guards", "checks", "foreign-keys")
    url = system.set_up()

    try:
        ids = asyncio.run(write_three(system, url))
        with psycopg.connect(url, autocommit=True) as check:
            enabled = {row[0] for row in check.execute(ENABLED_TRIGGERS)}
            constraints = check.execute(GUARD_CONSTRAINTS).fetchone()
            unchained = check.execute(
                "SELECT count(*) FROM operation_events WHERE hash IS NULL AND seq IS NULL"
            ).fetchone()
        assert enabled == {"outbox_notify_pending", "operation_events_notify_changed"}
        assert constraints == (0,)
        assert unchained == (3,)  # each decision's operation.prepared, with no chain
        assert len(set(ids)) == 3
    finally:
        system.tear_down()


def test_stripping_only_the_chain_leaves_every_guard(context: Context) -> None:
    system = stripped_outbox(context, "chain")
    url = system.set_up()
    try:
        with psycopg.connect(url, autocommit=True) as check:
            enabled = {row[0] for row in check.execute(ENABLED_TRIGGERS)}
            constraints = check.execute(GUARD_CONSTRAINTS).fetchone()
        assert "operation_events_chain" not in enabled
        assert {"operations_guard_birth", "operations_guard_transition"} <= enabled
        assert {"operation_events_by_role", "outbox_guard_row"} <= enabled
        assert constraints is not None
        assert constraints[0] > 0
    finally:
        system.tear_down()


def test_a_strip_of_nothing_known_is_refused_before_anything_changes(context: Context) -> None:
    system = stripped_outbox(context, "everything")
    try:
        with pytest.raises(ValueError, match="nothing called \\['everything'\\] to strip"):
            system.set_up()
        with psycopg.connect(context.admin_url, autocommit=True) as check:
            created = check.execute(
                "SELECT count(*) FROM pg_database WHERE datname = %s", (system.database().name,)
            ).fetchone()
    finally:
        system.tear_down()  # should it have been created after all, it does not stay
    assert created == (0,)
