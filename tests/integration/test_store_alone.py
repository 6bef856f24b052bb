"""``AsyncStore.alone``: a plan of one statement on an autocommit connection, where a
second statement would commit apart from the first, so the runner refuses to send it."""

from __future__ import annotations

import logging

import psycopg
import pytest

from outbox.store import AsyncStore, Plan, Step


def two_reads() -> Plan[int]:
    first = yield Step("schema_version", {})
    yield Step("schema_version", {})
    return int(first[0]["version"])


def one_read() -> Plan[int]:
    rows = yield Step("schema_version", {})
    return int(rows[0]["version"])


async def test_a_plan_of_one_statement_runs_alone(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as connection:
        version = await (await AsyncStore.alone(connection)).run(one_read())
    assert version >= 1


async def test_a_second_statement_is_refused_before_it_is_sent(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="outbox.store")
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as connection:
        runner = await AsyncStore.alone(connection)
        with pytest.raises(RuntimeError, match="second statement outside a transaction"):
            await runner.run(two_reads())
    sent = [r for r in caplog.records if getattr(r, "action", None) == "store.statement"]
    assert len(sent) == 1, [r.getMessage() for r in caplog.records]
