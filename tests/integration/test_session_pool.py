"""The consumer's connections (outbox.connections.SessionPool) on a real Postgres: kept
and reused while healthy, never handed out mid-transaction, and all dropped when one of
them is found dead, so a restarted server costs one failed transaction, not one per
pooled connection. A session that turned read-only (a demoted primary's) is dropped too,
so the next connect can find the writable host."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from outbox.connections import SessionPool
from outbox.errors import is_read_only
from outbox.failover import ServerTracker, follow_failovers
from outbox.settings import sqlalchemy_url


def pool_on(database_url: str, *, idle: int = 2, most: int = 4) -> tuple[SessionPool, list[int]]:
    """A pool on ``database_url`` and the list of the backend pids it opened, in order."""
    opened: list[int] = []

    async def connect() -> psycopg.AsyncConnection[Any]:
        connection = await psycopg.AsyncConnection.connect(database_url)
        opened.append(connection.info.backend_pid)
        return connection

    return SessionPool(connect, transaction_seconds=10, idle=idle, most=most), opened


async def backend_pid(pool: SessionPool) -> int:
    async with pool.transaction() as connection:
        cursor = await connection.execute("SELECT pg_backend_pid()")
        row = await cursor.fetchone()
        assert row is not None
        return int(row[0])


async def test_a_healthy_connection_is_reused(database_url: str) -> None:
    pool, opened = pool_on(database_url)
    try:
        first = await backend_pid(pool)
        second = await backend_pid(pool)
    finally:
        await pool.close()
    assert first == second
    assert opened == [first]


async def create_then_fail(pool: SessionPool) -> None:
    async with pool.transaction() as connection:
        await connection.execute("CREATE TABLE pool_probe (id int)")
        raise RuntimeError("refused by the body")


async def test_a_failed_body_rolls_back_and_the_connection_stays_usable(database_url: str) -> None:
    pool, opened = pool_on(database_url)
    try:
        with pytest.raises(RuntimeError, match="refused by the body"):
            await create_then_fail(pool)
        async with pool.transaction() as connection:
            cursor = await connection.execute("SELECT to_regclass('pool_probe') IS NULL")
            row = await cursor.fetchone()
    finally:
        await pool.close()
    assert row == (True,), "the failed transaction's table must not exist"
    assert len(opened) == 1, "a rolled-back connection is healthy and goes back to the pool"


async def test_a_dead_connection_drops_every_idle_one(database_url: str) -> None:
    pool, opened = pool_on(database_url, idle=2)
    held = asyncio.Event()
    release = asyncio.Event()

    async def hold_one() -> None:
        async with pool.transaction():
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold_one())
    try:
        await held.wait()
        await backend_pid(pool)  # a second connection, opened beside the held one
        release.set()
        await holder
        assert len(opened) == 2
        # The server goes away under both idle connections (a restart, a failover).
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as admin:
            for pid in opened:
                await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError):
            await backend_pid(pool)
        # The next transaction does not meet the other dead connection: it opens anew.
        fresh = await backend_pid(pool)
    finally:
        release.set()
        await pool.close()
    assert fresh not in opened[:2]
    assert opened[2:] == [fresh]


async def test_no_more_transactions_than_its_bound_run_at_once(database_url: str) -> None:
    pool, opened = pool_on(database_url, idle=1, most=2)
    inside = 0
    most_inside = 0
    both_in = asyncio.Event()
    release = asyncio.Event()

    async def one() -> None:
        nonlocal inside, most_inside
        async with pool.transaction():
            inside += 1
            most_inside = max(most_inside, inside)
            if inside == 2:
                both_in.set()
            await release.wait()
            inside -= 1

    tasks = [asyncio.create_task(one()) for _ in range(3)]
    try:
        await asyncio.wait_for(both_in.wait(), timeout=10)
        # The third waits for a slot: it has opened no connection of its own.
        assert len(opened) == 2
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    finally:
        release.set()
        await pool.close()
    assert most_inside == 2


async def make_read_only(pool: SessionPool) -> int:
    """Turn one pooled session read-only, as a demoted primary's sessions are; its pid."""
    async with pool.transaction() as connection:
        await connection.execute("SET SESSION default_transaction_read_only = on")
        cursor = await connection.execute("SELECT pg_backend_pid()")
        row = await cursor.fetchone()
        assert row is not None
        return int(row[0])


async def write(pool: SessionPool) -> None:
    async with pool.transaction() as connection:
        await connection.execute("CREATE TABLE IF NOT EXISTS pool_probe (id int)")


async def test_a_write_refused_as_read_only_drops_the_session_and_the_next_one_writes(
    database_url: str,
) -> None:
    pool, opened = pool_on(database_url, idle=1, most=1)
    try:
        read_only = await make_read_only(pool)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            await write(pool)
        await write(pool)
    finally:
        await pool.close()
    assert opened[0] == read_only
    assert len(opened) == 2  # the read-only session was not handed out again


async def test_an_engine_that_follows_failovers_drops_a_read_only_session(
    database_url: str,
) -> None:
    engine = create_async_engine(sqlalchemy_url(database_url), pool_size=1, max_overflow=0)
    moves: list[tuple[str, str]] = []
    tracker = ServerTracker(lambda old, new: moves.append((old, new)))
    follow_failovers(engine, tracker)
    try:
        async with engine.connect() as connection:
            await connection.execute(sa.text("SET SESSION default_transaction_read_only = on"))
            await connection.commit()
        with pytest.raises(sa.exc.DBAPIError) as refused:
            async with engine.begin() as connection:
                await connection.execute(sa.text("CREATE TABLE pool_probe (id int)"))
        async with engine.begin() as connection:
            await connection.execute(sa.text("CREATE TABLE pool_probe (id int)"))
    finally:
        await engine.dispose()
    assert is_read_only(refused.value)
    assert tracker.address is not None
    assert moves == []  # a new session on the same server is no failover


async def test_a_statement_runs_in_autocommit_and_its_connection_returns_to_transactions(
    database_url: str,
) -> None:
    pool, opened = pool_on(database_url)
    try:
        async with pool.statement() as connection:
            await connection.execute("CREATE TABLE alone_probe (id int)")
            # No BEGIN was sent: nothing is open once the statement has ended.
            after_statement = connection.info.transaction_status
        async with pool.transaction() as connection:
            await connection.execute("INSERT INTO alone_probe VALUES (1)")
            inside_transaction = connection.info.transaction_status
            autocommit_in_transaction = connection.autocommit
    finally:
        await pool.close()
    assert after_statement is psycopg.pq.TransactionStatus.IDLE
    assert inside_transaction is psycopg.pq.TransactionStatus.INTRANS
    assert autocommit_in_transaction is False
    assert len(opened) == 1, "the statement's connection is the one the transaction reused"


async def test_a_failed_statement_leaves_a_connection_that_still_opens_transactions(
    database_url: str,
) -> None:
    pool, opened = pool_on(database_url)
    try:
        with pytest.raises(psycopg.errors.UndefinedTable):
            async with pool.statement() as connection:
                await connection.execute("INSERT INTO no_such_table VALUES (1)")
        async with pool.transaction() as connection:
            await connection.execute("CREATE TABLE after_failure (id int)")
            autocommit = connection.autocommit
            raise_after = connection.info.transaction_status
    finally:
        await pool.close()
    assert autocommit is False
    assert raise_after is psycopg.pq.TransactionStatus.INTRANS
    assert len(opened) == 1
