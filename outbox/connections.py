"""Database sessions with a bounded life when their peer goes silent.

A half-open TCP link (a NAT entry timed out, a failover, a cable) during a commit leaves
the server's session idle in its transaction, holding the rows it touched, while the
client waits for an answer that never comes. Without bounds that lasts forever: a lease
that expires on a locked row can never be taken over, and an outbox batch that another
dispatcher skips (``SKIP LOCKED``) is never published. Three layers end it:

- client, kernel: TCP keepalives and ``tcp_user_timeout`` (libpq parameters) drop a
  link whose peer stopped answering, for a session idle in the pool or mid-statement;
- client, event loop: every daemon transaction runs under a deadline; when it passes,
  the connection's socket is shut down, so whatever libpq waits for fails at once
  (a cooperative cancel would first ask the silent server to cancel, and wait);
- server: ``idle_in_transaction_session_timeout``, ``statement_timeout`` and
  ``lock_timeout`` are set for every daemon session, so the server ends a session
  whose client went away and releases its locks even if the client never comes back.

All defaults derive from the lease margin (:class:`DatabaseBounds`): a record
transaction starts at the latest one margin before the lease expires; cut by the client
within half a margin and by the server within half a margin of its last statement, its
locks are gone before the lease runs out, so the reconciler can always take over.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.errors import TransientDatabaseError, is_read_only
from outbox.settings import Settings

# The settings every daemon offers as flags for the bounds below.
DATABASE_BOUND_SETTINGS = (
    "db_transaction_timeout",
    "db_statement_timeout",
    "db_lock_timeout",
    "db_idle_in_transaction_timeout",
    "db_tcp_user_timeout",
    "db_keepalives_idle",
    "db_keepalives_interval",
    "db_keepalives_count",
    "db_connect_timeout",
)


class TransactionDeadlineExceeded(TransientDatabaseError):
    """A transaction outlived its deadline and its connection was cut; what it wrote is
    rolled back by the server, or committed if the commit had already landed."""


@dataclass(frozen=True)
class DatabaseBounds:
    """How long each part of a daemon's database session may last, in seconds."""

    transaction: float
    statement: float
    lock: float
    idle_in_transaction: float
    tcp_user_timeout: float
    keepalives_idle: int
    keepalives_interval: int
    keepalives_count: int
    connect_timeout: int

    @classmethod
    def from_settings(cls, settings: Settings, *, held_open_for: float = 0.0) -> DatabaseBounds:
        """The bounds for a daemon; ``held_open_for`` is how long it may legitimately
        keep a transaction open between statements (the dispatcher waits for the
        broker's confirms inside its batch transaction)."""
        transaction = settings.db_transaction_timeout or settings.lease_margin / 2
        return cls(
            transaction=transaction + held_open_for,
            statement=settings.db_statement_timeout or transaction,
            lock=settings.db_lock_timeout or transaction / 2,
            idle_in_transaction=(settings.db_idle_in_transaction_timeout or transaction)
            + held_open_for,
            tcp_user_timeout=settings.db_tcp_user_timeout,
            keepalives_idle=settings.db_keepalives_idle,
            keepalives_interval=settings.db_keepalives_interval,
            keepalives_count=settings.db_keepalives_count,
            connect_timeout=settings.db_connect_timeout,
        )

    def libpq_parameters(self, *, server_timeouts: bool = True) -> dict[str, Any]:
        """Keyword arguments for ``psycopg.connect`` (and SQLAlchemy's ``connect_args``).
        ``server_timeouts=False`` for a session that must not be cut by the server, such
        as a migration's DDL."""
        parameters: dict[str, Any] = {
            "connect_timeout": self.connect_timeout,
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle,
            "keepalives_interval": self.keepalives_interval,
            "keepalives_count": self.keepalives_count,
            "tcp_user_timeout": _milliseconds(self.tcp_user_timeout),
        }
        if server_timeouts:
            parameters["options"] = " ".join(
                f"-c {name}={_milliseconds(seconds)}"
                for name, seconds in (
                    ("statement_timeout", self.statement),
                    ("lock_timeout", self.lock),
                    ("idle_in_transaction_session_timeout", self.idle_in_transaction),
                )
            )
        return parameters

    def fields(self) -> dict[str, float]:
        """Every bound as log fields, for a daemon's start line."""
        return {
            "db_transaction_s": self.transaction,
            "db_statement_s": self.statement,
            "db_idle_in_transaction_s": self.idle_in_transaction,
            "db_lock_s": self.lock,
            "db_tcp_user_timeout_s": self.tcp_user_timeout,
        }


def command_parameters(settings: Settings | None = None) -> dict[str, Any]:
    """libpq parameters for a one-shot command's session: the same keepalives, no
    server-side statement bounds (a migration or an operator's query may be long).
    Without settings, the defaults (no environment is read)."""
    bounds = DatabaseBounds.from_settings(settings or Settings.model_construct())
    return bounds.libpq_parameters(server_timeouts=False)


def _milliseconds(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def sever(connection: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> None:
    """Shut the connection's socket down in both directions: any read or write libpq is
    waiting on fails at once, as if the peer had reset the link. The socket stays open
    (libpq owns the descriptor and closes it when the connection is discarded)."""
    try:
        descriptor = connection.pgconn.socket
    except psycopg.Error:
        return  # closed already: nothing left to cut
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(descriptor)) as duplicate:
        duplicate.shutdown(socket.SHUT_RDWR)


@contextlib.asynccontextmanager
async def deadline(connection: psycopg.AsyncConnection[Any], seconds: float) -> AsyncIterator[None]:
    """Run the body with ``connection`` cut when ``seconds`` pass; a body that fails
    after the cut raises :class:`TransactionDeadlineExceeded`."""
    loop = asyncio.get_running_loop()
    cut = False

    def cut_link() -> None:
        nonlocal cut
        cut = True
        sever(connection)

    timer = loop.call_later(seconds, cut_link)
    try:
        yield
    except Exception as failure:
        if cut:
            raise TransactionDeadlineExceeded(
                f"a database transaction took longer than {seconds:g} s; its connection "
                "was cut (OUTBOX_DB_TRANSACTION_TIMEOUT)"
            ) from failure
        raise
    finally:
        timer.cancel()


@contextlib.asynccontextmanager
async def bounded_transaction(
    engine: AsyncEngine, seconds: float
) -> AsyncIterator[SAAsyncConnection]:
    """``engine.begin()`` whose connection is cut if the transaction, commit included,
    takes longer than ``seconds``. Taking a pooled connection involves no round trip (no
    pre-ping: a dead pooled connection fails its first statement, and SQLAlchemy then
    discards the whole pool); opening a new one is bounded by ``connect_timeout``."""
    async with engine.connect() as connection:
        raw = await connection.get_raw_connection()
        driver = raw.driver_connection
        assert isinstance(driver, psycopg.AsyncConnection)
        async with deadline(driver, seconds), connection.begin():
            yield connection


class SessionPool:
    """A daemon's own psycopg connections, each transaction under a deadline.

    Native psycopg rather than SQLAlchemy's async engine: a daemon runs only named
    statements, and the engine's greenlet bridge and result wrapping cost more client CPU
    per transaction than the statements themselves. Connections open on demand (a
    connect is bounded by ``connect_timeout``), so a database outage fails the checkout
    at once instead of queueing behind a background reconnect. There is no pre-ping: a
    dead idle connection fails its transaction's first statement (a transient error), and
    then every idle connection is dropped, since a link that died took its siblings'
    server with it more often than not. A write refused as read-only drops them too.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]],
        *,
        transaction_seconds: float,
        idle: int,
        most: int,
    ) -> None:
        self._connect = connect
        self._transaction_seconds = transaction_seconds
        self._keep_idle = max(1, idle)
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(max(self._keep_idle, most))

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection in a transaction that commits when the block ends, and whose
        link is cut if the transaction, commit included, outlives its deadline."""
        async with self._slots:
            connection = self._idle.pop() if self._idle else await self._connect()
            read_only = False
            try:
                async with (
                    deadline(connection, self._transaction_seconds),
                    connection.transaction(),
                ):
                    yield connection
            except Exception as error:
                read_only = is_read_only(error)
                raise
            finally:
                await self._release(connection, read_only=read_only)

    async def _release(
        self, connection: psycopg.AsyncConnection[Any], *, read_only: bool = False
    ) -> None:
        # A server that refused a write as read-only is a standby or a demoted primary:
        # the same session would refuse every write after it, and its idle siblings reach
        # the same server. A new connection lets libpq (target_session_attrs=read-write)
        # find the writable host.
        if connection.broken or connection.closed or read_only:
            await self._drop_idle()
        elif (
            connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            and len(self._idle) < self._keep_idle
        ):
            self._idle.append(connection)
            return
        await connection.close()

    async def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.close()

    async def close(self) -> None:
        await self._drop_idle()
