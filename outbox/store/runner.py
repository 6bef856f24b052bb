"""The runner: the one place effect-outbox's plans meet a database connection.

Each named operation is written once, as a *plan*: a generator that yields
``(query name, parameters)`` steps and receives each step's rows. A sync runner and
an async runner drive the same plan over whatever connection the caller holds:

- SQLAlchemy 2 ``Connection`` or ``Session``, or plain ``psycopg.Connection``;
- SQLAlchemy ``AsyncConnection`` or ``AsyncSession``, or ``psycopg.AsyncConnection``.

A step names a statement of ``outbox/sql/queries.sql``; the executors here look it up
and run it, so no plan holds SQL text. On psycopg connections they decode stored JSON
through :func:`outbox.bounds.load` (on their own cursor, never the caller's connection),
so a hostile value becomes a marker instead of an exception that loses the other rows.
Plans run inside the caller's transaction and never commit: the caller's commit is what
makes an operation, its outbox row and its event exist, together or not at all.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import psycopg
import psycopg.rows
from psycopg.pq import TransactionStatus
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine as SAEngine
from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
from sqlalchemy.ext.asyncio import AsyncSession as SAAsyncSession
from sqlalchemy.orm import Session as SASession

from outbox import bounds, lifecycle
from outbox.errors import ConfigurationError, wrap_database_errors
from outbox.logs import log_fields
from outbox.sql import QUERIES

# At DEBUG, one line per statement sent: its name, the database user that sent it and
# how many rows came back; never its parameters.
statements = logging.getLogger("outbox.store")

Row = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class Step:
    """One statement of a plan: a query's name in ``queries.sql`` and its parameters."""

    query: str
    params: Mapping[str, Any]


Plan = Generator[Step, list[Row], T]

SyncConnection = SAConnection | SASession | psycopg.Connection[Any]
AsyncConnection = SAAsyncConnection | SAAsyncSession | psycopg.AsyncConnection[Any]


# One executor per connection flavour, all of them speaking psycopg underneath.
class _SyncExecutor(Protocol):
    def fetch(self, step: Step) -> list[Row]: ...

    def committed_each_statement(self) -> bool: ...


class _AsyncExecutor(Protocol):
    async def fetch(self, step: Step) -> list[Row]: ...

    def committed_each_statement(self) -> bool: ...


# Statements whose answer never changes for a database: asked once per process and
# database, then answered from memory (a round trip saved on every decision).
_IMMUTABLE_QUERIES = frozenset({"fingerprint_key"})
_remembered: dict[tuple[str, str], list[Row]] = {}


# A connection's server, database and user are fixed when it connects; reading them back
# from libpq costs more than the rest of a remembered lookup, so once per connection.
_databases: weakref.WeakKeyDictionary[
    psycopg.Connection[Any] | psycopg.AsyncConnection[Any], str
] = weakref.WeakKeyDictionary()


def _database_of(driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    database = _databases.get(driver)
    if database is None:
        # Per user too: each role proves on its own that it may read what it is served.
        info = driver.info
        database = _databases[driver] = f"{info.user}@{info.host}:{info.port}/{info.dbname}"
    return database


class _ConnectionFacts:
    """What the runner reads off an executor's psycopg connection: the database key of
    remembered answers, and the user its DEBUG statement lines name."""

    @property
    def driver(self) -> psycopg.Connection[Any] | psycopg.AsyncConnection[Any]:
        raise NotImplementedError

    @property
    def database(self) -> str:
        return _database_of(self.driver)

    @property
    def user(self) -> str:
        return self.driver.info.user

    def committed_each_statement(self) -> bool:
        """Whether the statements sent so far committed as they ran."""
        return _commits_each_statement(self.driver)


def _commits_each_statement(
    driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
) -> bool:
    """Autocommit, and no transaction block open: each statement commits as it runs."""
    return driver.autocommit and driver.info.transaction_status == TransactionStatus.IDLE


def _has_rows(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> bool:
    """Whether the statement returned columns to fetch: what ``cursor.description`` says,
    without building a Column object per column: for the 23 columns of an operations
    row that took tens of microseconds a statement, more than recording's own Python."""
    result = cursor.pgresult
    return result is not None and result.nfields > 0


class _Needs(enum.Enum):
    """What a runner asks of its connection's transaction state."""

    TRANSACTION = "transaction"
    """A transaction the caller commits: an autocommit connection outside a transaction
    block is refused, since related writes would not commit together."""
    ANYTHING = "anything"
    """Statements that stand alone (LISTEN, reads): any state."""
    AUTOCOMMIT = "autocommit"
    """Each statement its own transaction: a connection in autocommit mode outside a
    transaction block, where nothing waits for a commit that may never come."""


def _check_driver_connection(driver: object, needs: _Needs) -> None:
    if not isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
        raise ConfigurationError(
            f"effect-outbox needs the psycopg 3 driver, got {type(driver).__module__}."
            f"{type(driver).__name__}; use a postgresql+psycopg:// URL"
        )
    statements_commit = _commits_each_statement(driver)
    if needs is _Needs.TRANSACTION and statements_commit:
        raise ConfigurationError(
            "the connection is in autocommit mode outside a transaction: the operation, its "
            "outbox row and its event would not commit together with your other writes. "
            "Open a transaction first (engine.begin(), session.begin(), or psycopg's "
            "conn.transaction()), or record it as a transaction of its own "
            "(own_transaction=True)"
        )
    if needs is _Needs.AUTOCOMMIT and not statements_commit:
        raise ConfigurationError(
            "own_transaction=True needs a connection in autocommit mode outside a "
            "transaction block (psycopg: autocommit=True; SQLAlchemy: "
            "execution_options(isolation_level='AUTOCOMMIT')); on this one the decision "
            "would wait for a commit that may never come"
        )


# Lifecycle lines of a plan run on a SQLAlchemy connection wait in the DBAPI connection's
# info for the transaction's end: written when it commits, dropped when it rolls back.
# SQLAlchemy's "commit" event fires as the commit is issued, so a commit that then fails
# still writes them; a plain psycopg connection has no such event, so there they are
# written as each plan finishes (the caller's rollback cannot take them back).
_HELD_LINES = "outbox_lifecycle_lines"
_ENGINES_OBSERVED: weakref.WeakSet[SAEngine] = weakref.WeakSet()


def _hold_until_commit(
    connection: SAConnection,
    lines: list[lifecycle.Line],
    executor: _SyncExecutor | _AsyncExecutor,
) -> None:
    if not lines:
        return
    if executor.committed_each_statement():
        # An AUTOCOMMIT connection outside a transaction: each statement has committed
        # already, and the commit event may never come (nothing to commit).
        lifecycle.write_all(lines)
        return
    engine = connection.engine
    if engine not in _ENGINES_OBSERVED:
        sa_event.listen(engine, "commit", _write_held_lines)
        sa_event.listen(engine, "rollback", _drop_held_lines)
        _ENGINES_OBSERVED.add(engine)
    connection.info.setdefault(_HELD_LINES, []).extend(lines)


def _write_held_lines(connection: SAConnection) -> None:
    lifecycle.write_all(connection.info.pop(_HELD_LINES, []))


def _drop_held_lines(connection: SAConnection) -> None:
    connection.info.pop(_HELD_LINES, None)


class _SQLAlchemyExecutor(_ConnectionFacts):
    def __init__(self, connection: SAConnection, needs: _Needs) -> None:
        _check_driver_connection(connection.connection.driver_connection, needs)
        self._connection = connection

    @property
    def commit_observer(self) -> SAConnection:
        return self._connection

    @property
    def driver(self) -> psycopg.Connection[Any]:
        driver = self._connection.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        return driver

    def fetch(self, step: Step) -> list[Row]:
        result = self._connection.exec_driver_sql(QUERIES[step.query].sql, dict(step.params))
        return [dict(row) for row in result.mappings()] if result.returns_rows else []


class _PsycopgExecutor(_ConnectionFacts):
    def __init__(self, connection: psycopg.Connection[Any], needs: _Needs) -> None:
        _check_driver_connection(connection, needs)
        self._connection = connection

    @property
    def driver(self) -> psycopg.Connection[Any]:
        return self._connection

    def fetch(self, step: Step) -> list[Row]:
        with self._connection.cursor(row_factory=psycopg.rows.dict_row) as cursor:
            if not bounds.bound(self._connection):
                bounds.bind(cursor)
            cursor.execute(QUERIES[step.query].sql, step.params)
            return cursor.fetchall() if _has_rows(cursor) else []


class _SQLAlchemyAsyncExecutor(_ConnectionFacts):
    def __init__(self, connection: SAAsyncConnection, needs: _Needs) -> None:
        self._connection = connection
        self._needs = needs
        self._checked = False

    @property
    def commit_observer(self) -> SAConnection | None:
        return self._connection.sync_connection

    @property
    def driver(self) -> psycopg.AsyncConnection[Any]:
        sync = self._connection.sync_connection
        driver = sync.connection.driver_connection if sync is not None else None
        assert isinstance(driver, psycopg.AsyncConnection)
        return driver

    async def fetch(self, step: Step) -> list[Row]:
        if not self._checked:
            raw = await self._connection.get_raw_connection()
            _check_driver_connection(raw.driver_connection, self._needs)
            self._checked = True
        result = await self._connection.exec_driver_sql(QUERIES[step.query].sql, dict(step.params))
        return [dict(row) for row in result.mappings()] if result.returns_rows else []


class _PsycopgAsyncExecutor(_ConnectionFacts):
    def __init__(self, connection: psycopg.AsyncConnection[Any], needs: _Needs) -> None:
        _check_driver_connection(connection, needs)
        self._connection = connection

    @property
    def driver(self) -> psycopg.AsyncConnection[Any]:
        return self._connection

    async def fetch(self, step: Step) -> list[Row]:
        async with self._connection.cursor(row_factory=psycopg.rows.dict_row) as cursor:
            if not bounds.bound(self._connection):
                bounds.bind(cursor)
            await cursor.execute(QUERIES[step.query].sql, step.params)
            return await cursor.fetchall() if _has_rows(cursor) else []


def _sync_executor(connection: SyncConnection, needs: _Needs) -> _SyncExecutor:
    if isinstance(connection, SASession):
        return _SQLAlchemyExecutor(connection.connection(), needs)
    if isinstance(connection, SAConnection):
        return _SQLAlchemyExecutor(connection, needs)
    if isinstance(connection, psycopg.Connection):
        return _PsycopgExecutor(connection, needs)
    raise ConfigurationError(_unsupported(connection, "a sync"))


async def _async_executor(connection: AsyncConnection, needs: _Needs) -> _AsyncExecutor:
    if isinstance(connection, SAAsyncSession):
        return _SQLAlchemyAsyncExecutor(await connection.connection(), needs)
    if isinstance(connection, SAAsyncConnection):
        return _SQLAlchemyAsyncExecutor(connection, needs)
    if isinstance(connection, psycopg.AsyncConnection):
        return _PsycopgAsyncExecutor(connection, needs)
    raise ConfigurationError(_unsupported(connection, "an async"))


def _unsupported(connection: object, flavour: str) -> str:
    return (
        f"{type(connection).__name__} is not {flavour} connection effect-outbox can use; pass "
        "a SQLAlchemy Connection/Session (AsyncConnection/AsyncSession for async) or a "
        "psycopg (Async)Connection"
    )


def _needs(require_transaction: bool, own_transaction: bool) -> _Needs:
    if own_transaction:
        return _Needs.AUTOCOMMIT
    return _Needs.TRANSACTION if require_transaction else _Needs.ANYTHING


class Store:
    """Runs plans on a sync connection, inside the caller's transaction.

    ``require_transaction=False`` admits an autocommit connection, for statements that
    stand alone (LISTEN, reads); anything that writes related rows keeps the default.
    ``own_transaction=True`` requires an autocommit connection outside a transaction
    block, for a plan whose every statement is whole on its own (a decision).
    """

    def __init__(
        self,
        connection: SyncConnection,
        *,
        require_transaction: bool = True,
        own_transaction: bool = False,
    ) -> None:
        self._executor = _sync_executor(connection, _needs(require_transaction, own_transaction))

    def run(self, plan: Plan[T]) -> T:
        observer = getattr(self._executor, "commit_observer", None)
        if observer is None:
            return self._run(plan)
        with lifecycle.held() as lines:
            result = self._run(plan)
        _hold_until_commit(observer, lines, self._executor)
        return result

    def _run(self, plan: Plan[T]) -> T:
        rows: list[Row] | None = None
        try:
            while True:
                step = plan.send(rows) if rows is not None else next(plan)
                remembered = _remembered_rows(self._executor, step)
                if remembered is not None:
                    rows = remembered
                    continue
                with wrap_database_errors(step.query):
                    rows = self._executor.fetch(step)
                if statements.isEnabledFor(logging.DEBUG):
                    _log_statement(self._executor, step, rows)
                _remember(self._executor, step, rows)
        except StopIteration as finished:
            return finished.value  # type: ignore[no-any-return]


class AsyncStore:
    """Runs plans on an async connection, inside the caller's transaction.

    :meth:`alone` runs a plan of one statement on an autocommit connection instead,
    where the statement is its own transaction.
    """

    def __init__(self, executor: _AsyncExecutor, *, one_statement: bool = False) -> None:
        self._executor = executor
        self._one_statement = one_statement

    @classmethod
    async def on(
        cls,
        connection: AsyncConnection,
        *,
        require_transaction: bool = True,
        own_transaction: bool = False,
    ) -> AsyncStore:
        """A runner on ``connection``; ``require_transaction`` and ``own_transaction`` as
        :class:`Store`'s."""
        needs = _needs(require_transaction, own_transaction)
        return cls(await _async_executor(connection, needs))

    @classmethod
    async def alone(cls, connection: psycopg.AsyncConnection[Any]) -> AsyncStore:
        """A runner for plans that send one statement, on an autocommit connection: a
        second statement would commit apart from the first, so it is refused unsent."""
        return cls(await _async_executor(connection, _Needs.ANYTHING), one_statement=True)

    async def run(self, plan: Plan[T]) -> T:
        observer = getattr(self._executor, "commit_observer", None)
        if observer is None:
            return await self._run(plan)
        with lifecycle.held() as lines:
            result = await self._run(plan)
        _hold_until_commit(observer, lines, self._executor)
        return result

    async def _run(self, plan: Plan[T]) -> T:
        rows: list[Row] | None = None
        sent = 0
        try:
            while True:
                step = plan.send(rows) if rows is not None else next(plan)
                remembered = _remembered_rows(self._executor, step)
                if remembered is not None:
                    rows = remembered
                    continue
                if self._one_statement and sent:
                    plan.close()
                    raise RuntimeError(
                        f"{step.query!r} would be a second statement outside a transaction; "
                        "run this plan in one"
                    )
                sent += 1
                with wrap_database_errors(step.query):
                    rows = await self._executor.fetch(step)
                if statements.isEnabledFor(logging.DEBUG):
                    _log_statement(self._executor, step, rows)
                _remember(self._executor, step, rows)
        except StopIteration as finished:
            return finished.value  # type: ignore[no-any-return]


def _log_statement(executor: object, step: Step, rows: list[Row]) -> None:
    log_fields(
        statements,
        logging.DEBUG,
        "store.statement",
        "ran a named statement",
        query=step.query,
        user=getattr(executor, "user", None),
        rows=len(rows),
    )


def _remembered_rows(executor: object, step: Step) -> list[Row] | None:
    if step.query not in _IMMUTABLE_QUERIES:
        return None
    database = getattr(executor, "database", None)
    return _remembered.get((database, step.query)) if database else None


def _remember(executor: object, step: Step, rows: list[Row]) -> None:
    if step.query in _IMMUTABLE_QUERIES and rows:
        database = getattr(executor, "database", None)
        if database:
            _remembered[(database, step.query)] = rows
