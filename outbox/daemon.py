"""What the dispatcher and the consumer share: which failures a new session may cure,
how long to wait before the next one, and the frame of a daemon's life (serve
``/metrics`` and ``/healthz``, log that it started, keep a session up through every
transient failure, log that it stopped).

The decisions that make each daemon what it is stay in their packages; only the
scaffold lives here, so both daemons back off, log and stop the same way.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal, TypeVar, get_args

import aiormq.exceptions
import psycopg
import sqlalchemy.exc
import tenacity
from prometheus_client import CollectorRegistry, Counter

from outbox.backoff import Backoff
from outbox.broker import BrokerUnavailable
from outbox.errors import (
    ConfigurationError,
    TransientDatabaseError,
    connect_advice,
    connect_failure,
)
from outbox.failover import ServerTracker
from outbox.logs import log_fields
from outbox.observability import serve_http
from outbox.settings import Settings
from outbox.signals import Stoppable
from outbox.store import LockHolder
from outbox.urls import database_name

T = TypeVar("T")
Peer = Literal["database", "broker"]
PEERS: tuple[Peer, ...] = get_args(Peer)

# A database that went away or restarted: what the store raises, what psycopg raises
# outside the store, and what SQLAlchemy raises when it cannot even open a connection.
TRANSIENT_DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    TransientDatabaseError,
    psycopg.OperationalError,
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
)
# A broker that went away, restarted, closed the channel or garbled a frame.
TRANSIENT_BROKER_ERRORS: tuple[type[BaseException], ...] = (
    BrokerUnavailable,
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ChannelClosed,
    aiormq.exceptions.ProtocolSyntaxError,
)
# Channel errors that no new session cures: arguments that differ from the declared
# queue's, or a user the broker refuses. Retrying them hides a misconfiguration.
_CONFIGURATION_BROKER_ERRORS = (
    aiormq.exceptions.ChannelPreconditionFailed,
    aiormq.exceptions.ChannelAccessRefused,
)


def is_transient(error: BaseException) -> bool:
    """The one answer to "may a new session or transaction cure this?": the database
    or the broker went away, restarted or stalled, or the network between failed."""
    if isinstance(error, _CONFIGURATION_BROKER_ERRORS):
        return False
    # OSError covers refused and reset connections and TimeoutError.
    return isinstance(error, (*TRANSIENT_DATABASE_ERRORS, *TRANSIENT_BROKER_ERRORS, OSError))


def is_transient_database_error(error: BaseException) -> bool:
    """A transient failure met while talking to Postgres (its network errors included)."""
    return is_transient(error) and not isinstance(error, TRANSIENT_BROKER_ERRORS)


def failed_peer(error: BaseException) -> Peer:
    """Which peer a transient failure came from, for the log line and the metric label.
    A bare network error is the database's: the broker client wraps its own."""
    return "broker" if isinstance(error, TRANSIENT_BROKER_ERRORS) else "database"


# A daemon names the sessions its transactions wait for once in this long, however many
# of its transactions wait for the same ones.
LOCK_WAIT_REPEAT_SECONDS = 10.0


class Daemon(Stoppable):
    """The frame both daemons run in. A subclass names itself (``name`` prefixes every
    action it logs), picks its default metrics port and its logger, and says when it is
    healthy; :meth:`serving`, :meth:`keep_sessions` and :meth:`connect_with_retry` do
    the rest."""

    name: str
    default_metrics_port: int

    def __init__(self, settings: Settings, logger: logging.Logger) -> None:
        super().__init__()
        self.settings = settings
        self.logger = logger
        # pid plus a per-instance suffix: several daemons may share one process (tests).
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{id(self) % 10_000:04d}"
        self.metrics_port: int | None = None
        self.connect_attempts: int | None = None
        """None: keep trying to connect until stopped; a one-shot run gives up."""

    def healthy(self) -> bool:
        raise NotImplementedError

    def log(self, level: int, event: str, text: str, **fields: object) -> None:
        """One line as data: action ``<name>.<event>``, ``text`` for a person."""
        log_fields(self.logger, level, f"{self.name}.{event}", text, **fields)

    def lock_waits(
        self, counted: Counter | None = None
    ) -> Callable[[tuple[LockHolder, ...]], None]:
        """What a transaction of this daemon waiting for a lock says: ``counted`` goes up
        by one for each, and one line names the sessions it waits for (pid, role,
        state, how long), at most once every :data:`LOCK_WAIT_REPEAT_SECONDS` for the
        same ones, however many of its transactions wait for them."""
        said: dict[frozenset[int], float] = {}

        def waiting(blockers: tuple[LockHolder, ...]) -> None:
            if counted is not None:
                counted.inc()
            pids = frozenset(holder.pid for holder in blockers)
            now = time.monotonic()
            if now - said.get(pids, -LOCK_WAIT_REPEAT_SECONDS) < LOCK_WAIT_REPEAT_SECONDS:
                return
            for key in [key for key, at in said.items() if now - at >= LOCK_WAIT_REPEAT_SECONDS]:
                del said[key]
            said[pids] = now
            self.log(
                logging.WARNING,
                "lock_wait",
                "a transaction waits for a lock another session holds",
                waiting_for="; ".join(str(holder) for holder in blockers),
                do="end or commit that session's transaction; its role names who opened it",
            )

        return waiting

    def server_tracker(self, failovers: Counter) -> ServerTracker:
        """Follows the server this daemon's new database connections reach: a move to
        another one is counted and logged once (``<name>.database_failover``), by place."""

        def moved(previous: str, current: str) -> None:
            failovers.inc()
            self.log(
                logging.WARNING,
                "database_failover",
                "the database is on another server now; this daemon's sessions moved there",
                **{"from": previous, "to": current},
            )

        return ServerTracker(moved)

    @asynccontextmanager
    async def serving(self, registry: CollectorRegistry, **started: object) -> AsyncIterator[int]:
        """Serve ``/metrics`` and ``/healthz`` for the body, logging the start (with
        ``started`` as fields) and the stop. Yields the bound port."""
        port = self.settings.metrics_port
        port = self.default_metrics_port if port is None else port
        async with serve_http(self.settings.metrics_host, port, registry, self.healthy) as bound:
            self.metrics_port = bound
            self.log(
                logging.INFO,
                "started",
                "started",
                worker=self.worker_id,
                metrics_port=bound,
                **started,
            )
            yield bound
        self.log(logging.INFO, "stopped", "stopped", worker=self.worker_id)

    async def keep_sessions(
        self,
        session: Callable[[], Awaitable[None]],
        on_lost: Callable[[Peer], None],
    ) -> None:
        """Run ``session`` again and again until stopped. A transient failure ends a
        session: ``on_lost`` hears which peer failed, a line is logged and the next
        session starts after a backoff. Any other failure ends the daemon."""
        backoff = Backoff()
        while not self.stopping:
            started = time.monotonic()
            try:
                await session()
            except Exception as error:
                if not is_transient(error):
                    raise
                peer = failed_peer(error)
                on_lost(peer)
                delay = backoff.next_delay(session_lasted=time.monotonic() - started)
                self.log(
                    logging.WARNING,
                    "session_lost",
                    "lost its session; reconnecting",
                    peer=peer,
                    error=type(error).__name__,
                    retry_in=round(delay, 2),
                )
                await self._sleep(delay)

    async def connect_with_retry(self, connect: Callable[[], Awaitable[T]], peer: Peer) -> T:
        """``connect()`` with backoff until it works, the daemon is stopped, or
        :attr:`connect_attempts` (when set) run out; a failure that is not transient is
        raised at once."""
        backoff = Backoff()

        def log_retry(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            self.log(
                logging.WARNING,
                "connect_retry",
                "could not connect; retrying",
                peer=peer,
                attempt=state.attempt_number,
                error=type(error).__name__,
                **(
                    database_failure_fields(error, self.settings)
                    if peer == "database" and error
                    else {}
                ),
            )

        def give_up(state: tenacity.RetryCallState) -> bool:
            limit = self.connect_attempts
            return self.stopping or (limit is not None and state.attempt_number >= limit)

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(is_transient),
            wait=lambda _: backoff.next_delay(),
            stop=give_up,
            sleep=self._sleep,
            before_sleep=log_retry,
            reraise=True,
        )
        connected: T = await retrying(connect)
        return connected


def database_failure_fields(error: BaseException, settings: Settings) -> dict[str, str]:
    """Why a daemon could not connect to Postgres, for its retry line: which database,
    the cause in our words (never libpq's text, which can quote the URL) and, when
    waiting will not fix it, what to do."""
    cause = connect_failure(error)
    fields = {"database": _database_named(settings), "cause": cause}
    advice = connect_advice(cause)
    return {**fields, "do": advice} if advice else fields


def _database_named(settings: Settings) -> str:
    try:
        return database_name(settings.libpq_url)
    except ConfigurationError:
        return "(none named)"


def freeze_startup_heap() -> None:
    """Hide every object alive after start-up (modules, classes, settings) from the
    cyclic garbage collector, in a process that is one daemon and nothing else.

    A batch or a burst keeps hundreds of futures and tasks alive across young
    collections, so they reach the oldest generation and trigger full collections, each
    of which walked the whole start-up heap: 7 of them took 339 ms of one 20,000-row
    dispatcher drain of about 4.8 s. Objects created later are collected as before;
    garbage already in cycles is collected first. Only the commands call it: a process
    that embeds a daemon (a test, an application) keeps its heap as it is."""
    gc.collect()
    gc.freeze()
