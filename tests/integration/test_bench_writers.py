"""The e2e bench's effect-outbox writers against the real Postgres: ``outbox`` records
each decision as a transaction of its own, ``outbox-in-transaction`` in a transaction
block; both leave the operation each call returned, committed, and nothing else."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from bench.systems import Context, systems
from outbox.sandbox.scratch import new_tag

from support.db_helpers import Counts, committed_counts


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

    async def write() -> list[str]:
        enqueue, close = await system.writer(url)
        try:
            return [await enqueue(n) for n in range(3)]
        finally:
            await close()

    try:
        ids = asyncio.run(write())
        with psycopg.connect(url, autocommit=True) as check:
            stored = {
                str(row[0])
                for row in check.execute("SELECT id FROM operations WHERE state = 'prepared'")
            }
        assert stored == set(ids)
        assert committed_counts(url) == Counts(3, 3, 3)
    finally:
        system.tear_down()
