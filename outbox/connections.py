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
  (a cooperative cancel would first ask the silent server to cancel, and wait). The
  deadline bounds a *silent* link, not a slow server: at the soft deadline
  (``transaction``) a :class:`LivenessProbe` asks the server, on a connection of its
  own, whether it is working on the transaction's backend; a transaction the server is
  working on runs on until the hard deadline (``hard_transaction``), one whose link is
  silent (no answer, or a backend waiting for a client that never speaks) is cut;
- server: ``idle_in_transaction_session_timeout``, ``statement_timeout`` and
  ``lock_timeout`` are set for every daemon session, so the server ends a session
  whose client went away and releases its locks even if the client never comes back.

All defaults derive from the lease margin (:class:`DatabaseBounds`): a record
transaction starts at the latest one margin before the lease expires; checked by the
client at a quarter margin, cut by it within half a margin and by the server within half
a margin of its last statement, its locks are gone before the lease runs out, so the
reconciler can always take over.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import store
from outbox.errors import (
    ServiceUnavailable,
    TransientDatabaseError,
    connect_failure,
    is_read_only,
)
from outbox.settings import Settings, redact_url, settings_in

# The settings every daemon offers as flags for the bounds below.
DATABASE_BOUND_SETTINGS = settings_in("database_bound")


# What a transaction past its soft deadline came to (the verdict label of
# outbox_database_slow_transactions_total): the server was working on it and it ran on,
# its link was silent and it was cut, or it was still running at the hard deadline.
SLOW_WORKING = "working"
SLOW_SILENT = "silent"
SLOW_OVERRAN = "overran"
SLOW_VERDICTS = (SLOW_WORKING, SLOW_SILENT, SLOW_OVERRAN)
# How long a probe may take to answer, and how often a slow transaction is asked about
# again: a silent link fails the probe, and a server that went silent after a first
# answer is caught by the next one.
PROBE_SECONDS = 2.0
# A backend between statements (idle in its transaction) still counts as working if its
# state changed this recently: the client is sending its next statement. One that has
# waited longer waits for a client that does not hear it.
RECENT_STATE_SECONDS = 1.0
# A transaction still running this long into its deadline is asked whether it waits for
# a lock, and whom for: the daemon's log names that session (its pid and role) while the
# wait goes on, before a lock_timeout ends it with an error that only blames the
# database.
LOCK_WAIT_REPORT_SECONDS = 1.0


class TransactionDeadlineExceeded(TransientDatabaseError):
    """A transaction outlived its deadline and its connection was cut; what it wrote is
    rolled back by the server, or committed if the commit had already landed."""


@dataclass(frozen=True)
class DatabaseBounds:
    """How long each part of a daemon's database session may last, in seconds.
    ``transaction`` is the soft deadline (past it, the link is checked);
    ``hard_transaction`` cuts a transaction the server is still working on."""

    transaction: float
    hard_transaction: float
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
        soft = settings.db_transaction_timeout or settings.lease_margin / 4
        hard = max(soft, settings.db_transaction_hard_timeout or settings.lease_margin / 2)
        return cls(
            transaction=soft + held_open_for,
            hard_transaction=hard + held_open_for,
            statement=settings.db_statement_timeout or hard,
            lock=settings.db_lock_timeout or hard / 2,
            idle_in_transaction=(settings.db_idle_in_transaction_timeout or hard) + held_open_for,
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
            "db_transaction_hard_s": self.hard_transaction,
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


@contextlib.contextmanager
def command_transaction(settings: Settings) -> Iterator[psycopg.Connection[Any]]:
    """One transaction for one operator command or console request, on a session of its
    own: committed when the block ends normally, rolled back when it raises, so a
    refusal anywhere in it changes nothing."""
    url = settings.libpq_url
    try:
        connection = psycopg.connect(url, **command_parameters(settings))
    except psycopg.OperationalError as failure:
        # libpq's message may echo connection parameters: the cause is named in our words.
        raise ServiceUnavailable(
            f"could not connect to Postgres at {redact_url(url)}: {connect_failure(failure)}"
        ) from None
    with connection:
        yield connection


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


class LivenessProbe:
    """Asks the server, on a connection of its own, whether it is working on a backend.

    Working: the backend runs a statement (``active``, waiting for a lock or the disk
    included), or changed state within :data:`RECENT_STATE_SECONDS`. A silent link fails
    the probe: no answer within ``timeout`` is silence, and so is a backend idle in its
    transaction for longer, or none at all. Concurrent questions share one query, so a
    burst of slow transactions costs the server one look at ``pg_stat_activity``.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]],
        *,
        timeout: float = PROBE_SECONDS,
    ) -> None:
        self._connect = connect
        self.timeout = timeout
        self._connection: psycopg.AsyncConnection[Any] | None = None
        self._asking: asyncio.Task[dict[int, tuple[str, float]]] | None = None

    async def working(self, pid: int, *, recent: float = RECENT_STATE_SECONDS) -> bool:
        """Whether the server is working on backend ``pid``; False when it does not
        answer in time. A backend idle in its transaction for ``recent`` or longer
        waits for a silent client."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._look())
        try:
            # Shielded: a transaction that ends meanwhile stops waiting, and the query
            # others wait on goes on.
            backends = await asyncio.shield(self._asking)
        except Exception:
            return False
        state, idle_for = backends.get(pid, ("gone", 0.0))
        return is_working(state, idle_for, recent=recent)

    async def blockers(self, pid: int) -> tuple[store.LockHolder, ...]:
        """The sessions backend ``pid`` waits for, if it waits for a lock; none when it
        waits for nothing, or when the server does not answer in time."""
        try:
            async with asyncio.timeout(self.timeout):
                return await (await self._store()).run(store.lock_blockers(pid))
        except Exception:
            await self.close()
            return ()

    async def _look(self) -> dict[int, tuple[str, float]]:
        try:
            async with asyncio.timeout(self.timeout):
                return await (await self._store()).run(store.backend_activity())
        except BaseException:
            await self.close()
            raise

    async def _store(self) -> store.AsyncStore:
        if self._connection is None or self._connection.closed:
            self._connection = await self._connect()
            await self._connection.set_autocommit(True)
        return await store.AsyncStore.on(self._connection, require_transaction=False)

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            sever(connection)
            with contextlib.suppress(Exception):
                await connection.close()


def is_working(state: str, idle_for: float, *, recent: float = RECENT_STATE_SECONDS) -> bool:
    """The liveness decision: is a backend in ``state`` (``pg_stat_activity.state``),
    unchanged for ``idle_for`` seconds, being worked on by a server that hears its
    client? Running a statement (waiting for a lock or the disk included), yes; idle in
    its transaction, only if it answered less than ``recent`` seconds ago (the client
    is sending its next statement); anything else, or no such backend, no."""
    if state == "active":
        return True
    return state == "idle in transaction" and idle_for < recent


@contextlib.asynccontextmanager
async def deadline(
    connection: psycopg.AsyncConnection[Any],
    seconds: float,
    *,
    hard: float | None = None,
    probe: LivenessProbe | None = None,
    on_slow: Callable[[str], None] | None = None,
    on_lock_wait: Callable[[tuple[store.LockHolder, ...]], None] | None = None,
) -> AsyncIterator[None]:
    """Run the body with ``connection`` cut when ``seconds`` pass; a body that fails
    after the cut raises :class:`TransactionDeadlineExceeded`.

    With a ``probe``, ``on_lock_wait`` hears whom the transaction waits for if, still
    running :data:`LOCK_WAIT_REPORT_SECONDS` in, it waits for a lock (once a
    transaction).

    With a ``probe`` and a ``hard`` deadline past ``seconds``, the soft deadline cuts
    only a silent link: a transaction the server is working on runs on until ``hard``,
    asked about again every probe timeout. ``on_slow`` hears each verdict once (see
    :data:`SLOW_VERDICTS`)."""
    cut: str | None = None
    hard = seconds if hard is None or probe is None else max(seconds, hard)
    try:
        pid = connection.info.backend_pid
    except psycopg.Error:
        pid = 0

    def verdict(name: str) -> None:
        if on_slow is not None:
            on_slow(name)

    async def watch() -> None:
        nonlocal cut
        started = time.monotonic()
        if probe is not None and on_lock_wait is not None and seconds > LOCK_WAIT_REPORT_SECONDS:
            await asyncio.sleep(LOCK_WAIT_REPORT_SECONDS)
            blockers = await probe.blockers(pid)
            if blockers:
                on_lock_wait(blockers)
        await asyncio.sleep(max(0.0, seconds - (time.monotonic() - started)))
        reason = SLOW_SILENT
        if probe is not None and hard > seconds:
            reason = SLOW_OVERRAN
            said_working = False
            # A silent link leaves its backend idle since its last answer: within a
            # short deadline's half, an answer that recent is traffic still flowing.
            recent = min(RECENT_STATE_SECONDS, seconds / 2)
            while time.monotonic() - started < hard:
                if not await probe.working(pid, recent=recent):
                    reason = SLOW_SILENT
                    break
                if not said_working:
                    said_working = True
                    verdict(SLOW_WORKING)
                left = hard - (time.monotonic() - started)
                await asyncio.sleep(max(0.0, min(probe.timeout, left)))
        cut = reason
        verdict(reason)
        sever(connection)

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except Exception as failure:
        if cut is not None:
            which = "hard " if cut == SLOW_OVERRAN else ""
            limit = hard if cut == SLOW_OVERRAN else seconds
            raise TransactionDeadlineExceeded(
                f"a database transaction passed its {which}deadline of {limit:g} s "
                f"({'still running' if cut == SLOW_OVERRAN else 'its link silent'}); its "
                "connection was cut (OUTBOX_DB_TRANSACTION_TIMEOUT, "
                "OUTBOX_DB_TRANSACTION_HARD_TIMEOUT)"
            ) from failure
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


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
        hard_seconds: float | None = None,
        on_slow: Callable[[str], None] | None = None,
        on_lock_wait: Callable[[tuple[store.LockHolder, ...]], None] | None = None,
    ) -> None:
        self._connect = connect
        self._transaction_seconds = transaction_seconds
        self._hard_seconds = hard_seconds
        self._on_slow = on_slow
        self._on_lock_wait = on_lock_wait
        # Only a pool that may let a slow transaction run on needs to ask about it.
        self.probe = (
            LivenessProbe(connect)
            if hard_seconds is not None and hard_seconds > transaction_seconds
            else None
        )
        self._keep_idle = max(1, idle)
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots = asyncio.Semaphore(max(self._keep_idle, most))

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection in a transaction that commits when the block ends, and whose
        link is cut if the transaction, commit included, outlives its deadline: the soft
        one if the link is silent, the hard one if the server is working on it."""
        async with self._checkout() as connection, connection.transaction():
            yield connection

    @contextlib.asynccontextmanager
    async def statement(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection in autocommit, for one statement that is a transaction of its
        own, under the same deadline: the server commits it as it ends, which spares the
        BEGIN and COMMIT round trips. Two statements sent here commit apart."""
        async with self._checkout() as connection:
            await connection.set_autocommit(True)
            try:
                yield connection
            finally:
                # Only an idle connection goes back to the pool (see _release), and it
                # must go back as the transactions expect it.
                if connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                    await connection.set_autocommit(False)

    @contextlib.asynccontextmanager
    async def _checkout(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        async with self._slots:
            connection = self._idle.pop() if self._idle else await self._connect()
            read_only = False
            try:
                async with deadline(
                    connection,
                    self._transaction_seconds,
                    hard=self._hard_seconds,
                    probe=self.probe,
                    on_slow=self._on_slow,
                    on_lock_wait=self._on_lock_wait,
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
        if self.probe is not None:
            await self.probe.close()
