"""Test-side views of the database: a second connection that sees only what committed,
and the six connection flavours an agent service may hand to ``record_decision``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import schema as outbox_schema
from outbox.store import AsyncConnection as AnyAsyncConnection
from outbox.store import SyncConnection

SyncFlavor = Literal["sqlalchemy-connection", "sqlalchemy-session", "psycopg"]
AsyncFlavor = Literal["sqlalchemy-async-connection", "sqlalchemy-async-session", "psycopg-async"]
SYNC_FLAVORS: list[SyncFlavor] = ["sqlalchemy-connection", "sqlalchemy-session", "psycopg"]
ASYNC_FLAVORS: list[AsyncFlavor] = [
    "sqlalchemy-async-connection",
    "sqlalchemy-async-session",
    "psycopg-async",
]


@dataclass(frozen=True)
class Counts:
    operations: int
    outbox: int
    events: int
    business: int = 0


def committed_counts(database_url: str, *, business_table: str | None = None) -> Counts:
    """Row counts as a separate connection sees them: only what has committed."""
    with psycopg.connect(database_url, autocommit=True) as connection:

        def count(table: str) -> int:
            row = connection.execute(f"SELECT count(*) FROM {table}").fetchone()
            assert row is not None
            return int(row[0])

        return Counts(
            operations=count("operations"),
            outbox=count("outbox"),
            events=count("operation_events"),
            business=count(business_table) if business_table else 0,
        )


def execute_admin(
    database_url: str, sql: str, params: tuple[Any, ...] = ()
) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        cursor = connection.execute(sql, params or None)
        return cursor.fetchall() if cursor.description else []


def index_plan(database_url: str, sql: str, params: dict[str, Any] | None = None) -> str:
    """The plan of ``sql`` with a scan of a table and a sort forbidden (the planner
    would rather sort a handful of rows): whether an index can serve it at all."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL enable_seqscan = off")
        connection.execute("SET LOCAL enable_sort = off")
        return "\n".join(row[0] for row in connection.execute("EXPLAIN " + sql, params))


class SyncTransaction:
    def __init__(self, connection: SyncConnection) -> None:
        self.connection = connection

    def execute(self, sql: str, params: dict[str, Any]) -> None:
        if isinstance(self.connection, psycopg.Connection):
            self.connection.execute(sql.replace(":name", "%(name)s"), params)
        else:
            self.connection.execute(sa.text(sql), params)

    def commit(self) -> None:
        self.connection.commit()

    def rollback(self) -> None:
        self.connection.rollback()


@contextlib.contextmanager
def sync_transaction(
    flavor: SyncFlavor, database_url: str, engine: sa.Engine
) -> Iterator[SyncTransaction]:
    if flavor == "sqlalchemy-connection":
        with engine.connect() as connection:
            yield SyncTransaction(connection)
    elif flavor == "sqlalchemy-session":
        with Session(engine) as session:
            yield SyncTransaction(session)
    else:
        with psycopg.connect(database_url) as raw:
            yield SyncTransaction(raw)


class AsyncTransaction:
    def __init__(self, connection: AnyAsyncConnection) -> None:
        self.connection = connection

    async def execute(self, sql: str, params: dict[str, Any]) -> None:
        if isinstance(self.connection, psycopg.AsyncConnection):
            await self.connection.execute(sql.replace(":name", "%(name)s"), params)
        else:
            await self.connection.execute(sa.text(sql), params)

    async def commit(self) -> None:
        await self.connection.commit()

    async def rollback(self) -> None:
        await self.connection.rollback()


@contextlib.asynccontextmanager
async def async_transaction(
    flavor: AsyncFlavor, database_url: str, engine: AsyncEngine
) -> AsyncIterator[AsyncTransaction]:
    if flavor == "sqlalchemy-async-connection":
        connection: AsyncConnection
        async with engine.connect() as connection:
            yield AsyncTransaction(connection)
    elif flavor == "sqlalchemy-async-session":
        async with AsyncSession(engine) as session:
            yield AsyncTransaction(session)
    else:
        async with await psycopg.AsyncConnection.connect(database_url) as raw:
            yield AsyncTransaction(raw)


def migrate_again(database_url: str) -> tuple[bool, int, bool]:
    """For a database made to look older: whether it was told to migrate, the version
    ``apply_schema`` then reached, and whether the schema was current after."""
    with psycopg.connect(database_url) as connection:
        told_to_migrate = not outbox_schema.schema_is_current(connection)
    with psycopg.connect(database_url) as connection:
        migrated = outbox_schema.apply_schema(connection)
        current = outbox_schema.schema_is_current(connection)
    return told_to_migrate, migrated, current
