"""How a decision ended, for the agent that made it.

``record_decision`` hands a decision to the runtime; :func:`await_outcome` tells the
agent what became of it, so that ``agent.completed ... outcome=refund_confirmed`` is a
line an agent writes after it *knows*.

An :class:`Outcome` (:mod:`outbox.agent_outcome`) folds the operation's state into the
five answers an agent can act on: done, definitively not done, still running (call
again later), waiting for a person's approval, or with a person who checks the evidence.

Waiting is read-only and cancellation-safe: it never changes the operation, and a
timed-out wait says nothing about the operation, only that it had not reached the
statuses asked for (it returns the latest state, it does not raise).

One :class:`OutcomeWatcher` serves every waiter of a process on one dedicated
connection: it ``LISTEN``\\ s before its first read (a notification sent before that is
lost), answers all waiters with one batched status query per wake-up, and polls every
``poll_interval`` as the safety net for notifications that were never sent or were lost.

An operation the hot tables no longer hold (moved to history, docs/operating.md "History
retention") is asked for there once, by its decision key when the caller passed a
handle that carries one: its final outcome never changes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import psycopg.rows
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine as SAEngine
from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.asyncio import AsyncSession as SAAsyncSession
from sqlalchemy.orm import Session as SASession

from outbox import store
from outbox.agent_outcome import (
    Outcome,
    OutcomeStatus,
    Until,
    archived_without_key,
    decision_key_of,
    get_outcome,
    get_outcome_async,
    not_visible,
    outcome_from_row,
    outcome_rows,
    single_outcome,
    status_of_row,
    statuses_until,
)
from outbox.backoff import Backoff
from outbox.connections import command_parameters
from outbox.errors import ConfigurationError, DatabaseError, TransientDatabaseError
from outbox.logs import log_fields
from outbox.models import Operation, RecordedDecision, display_operation_id
from outbox.settings import libpq_url
from outbox.store import AsyncStore, Store

# Outcome, its statuses and the one-read calls live in outbox.agent_outcome; callers
# (outbox/__init__.py, the MCP server, the integrations) import them from here too.
__all__ = [
    "Outcome",
    "OutcomeStatus",
    "OutcomeWatcher",
    "await_outcome",
    "await_outcome_sync",
    "close_shared_watchers",
    "get_outcome",
    "get_outcome_async",
]

logger = logging.getLogger("outbox.awaiting")

DEFAULT_TIMEOUT = timedelta(seconds=30)
DEFAULT_POLL_INTERVAL = 1.0


# --- what callers pass ----------------------------------------------------------------


def awaited_id(operation: UUID | RecordedDecision | Operation | Outcome) -> UUID:
    """The id of what an agent waits on, whichever of its handles it passed (not a name
    a person typed: that is :func:`outbox.operator.views.operation_id_of`)."""
    if isinstance(operation, UUID):
        return operation
    if isinstance(operation, RecordedDecision):
        return operation.operation.id
    if isinstance(operation, Operation):
        return operation.id
    if isinstance(operation, Outcome):
        return operation.operation_id
    raise TypeError(
        "operation must be an operation id (UUID), a RecordedDecision, an Operation or an "
        f"Outcome, not {type(operation).__name__}"
    )


def _seconds(timeout: timedelta | float | None) -> float | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds < 0:
        raise ValueError("timeout must not be negative")
    return seconds


_CONNECTIONS = (
    SAConnection,
    SASession,
    SAAsyncConnection,
    SAAsyncSession,
    psycopg.Connection,
    psycopg.AsyncConnection,
)


def _as_outbox_error(error: BaseException) -> BaseException:
    if isinstance(error, psycopg.Error):
        return TransientDatabaseError(
            f"the outcome watcher could not connect: {type(error).__name__}"
        )
    return error


def _refuse_connection(source: object) -> None:
    if isinstance(source, _CONNECTIONS):
        raise ConfigurationError(
            "await_outcome needs an engine, a database URL or an OutcomeWatcher, not a "
            "connection: the connection that recorded the decision has not committed it "
            "yet, so no other session can see it settle, and waiting inside that "
            "transaction would hold it open until the wait times out. Commit first, then "
            "await with the engine"
        )


def _url_of(source: AsyncEngine | SAEngine | str) -> str:
    if isinstance(source, str):
        return libpq_url(source)
    if isinstance(source, AsyncEngine | SAEngine):
        return libpq_url(source.url.render_as_string(hide_password=False))
    raise TypeError(
        "source must be an AsyncEngine, an Engine, a database URL or an OutcomeWatcher, "
        f"not {type(source).__name__}"
    )


# --- the watcher ----------------------------------------------------------------------

CHANGES_CHANNEL = "outbox_operation_changed"


# A wait always answers with one read, even with ``timeout=0`` (a status check); how
# long it may take for that read when the database is slow or away.
FIRST_READ_WITHIN = 10.0
# A watcher serves waiting tool calls: it retries sooner and more often than a daemon.
WATCHER_FIRST_RETRY_SECONDS = 0.2
WATCHER_LONGEST_RETRY_SECONDS = 5.0


class _Waiter:
    __slots__ = ("future", "latest_row", "read", "target")

    def __init__(self, target: frozenset[OutcomeStatus], future: asyncio.Future[Outcome]):
        self.target = target
        self.future = future
        self.latest_row: dict[str, Any] | None = None
        self.read = asyncio.Event()

    @property
    def latest(self) -> Outcome | None:
        return None if self.latest_row is None else outcome_from_row(self.latest_row)


class OutcomeWatcher:
    """Waits for many operations at once on one dedicated autocommit connection.

    Use one per process and event loop::

        async with OutcomeWatcher(database_url) as watcher:
            outcome = await watcher.wait(recorded, timeout=20)

    ``listen=False`` (or a database that refuses ``LISTEN``) leaves the poll alone: a
    waiter is then answered within ``poll_interval`` of its operation settling.
    """

    def __init__(
        self,
        database: AsyncEngine | SAEngine | str,
        *,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        listen: bool = True,
        connect_parameters: dict[str, Any] | None = None,
    ) -> None:
        if poll_interval <= 0:
            raise ValueError("poll_interval must be positive")
        self._url = _url_of(database)
        self.poll_interval = poll_interval
        self.listen = listen
        self._connect_parameters = connect_parameters or command_parameters()
        self._waiters: dict[UUID, list[_Waiter]] = {}
        # The (run_id, decision_key) of each operation waited for that carries one.
        self._keys: dict[UUID, tuple[str, str]] = {}
        # The last row read of each operation waited for, with its row version.
        self._rows: dict[UUID, dict[str, Any]] = {}
        # Operations with a waiter that has not been answered by a read yet.
        self._arrived: set[UUID] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._closed_by_caller = False
        self._last_error: BaseException | None = None
        self.reads = 0
        """Batched status queries run so far (one per wake-up with waiters)."""
        self.notifications = 0
        self.listening = False

    async def __aenter__(self) -> OutcomeWatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect and (unless ``listen=False``) LISTEN; returns once that is done, so
        that a decision committed after ``start`` returns cannot go unnoticed."""
        if self.running:
            return
        self._closed = False
        self._closed_by_caller = False
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(ready), name="outbox-outcome-watcher")
        try:
            await ready
        except BaseException:
            await self._stop()
            raise

    async def close(self) -> None:
        """Stop watching. Waiters still waiting get their latest outcome, as on timeout."""
        self._closed_by_caller = True
        await self._stop()
        for waiters in self._waiters.values():
            for waiter in waiters:
                if waiter.future.done():
                    continue
                latest = waiter.latest
                if latest is not None:
                    waiter.future.set_result(latest)
                else:
                    waiter.future.set_exception(
                        TransientDatabaseError("the outcome watcher closed before its first read")
                    )

    async def _stop(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def waiting(self) -> int:
        return sum(len(waiters) for waiters in self._waiters.values())

    @property
    def pending_first_reads(self) -> int:
        """Waiters that have not had their first read yet."""
        return sum(
            not waiter.read.is_set() for waiters in self._waiters.values() for waiter in waiters
        )

    async def wait(
        self,
        operation: UUID | RecordedDecision | Operation | Outcome,
        *,
        # Not asyncio.timeout: a wait that times out returns the latest outcome.
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,  # noqa: ASYNC109
        until: Until = "attention",
    ) -> Outcome:
        """Return when the operation's status is in the ``until`` set, or the latest
        outcome when ``timeout`` passes. Raises :class:`OperationNotFound` for an id no
        session can see, and :class:`TransientDatabaseError` only when no read at all
        succeeded before the timeout."""
        operation_id = awaited_id(operation)
        target = statuses_until(until)
        seconds = _seconds(timeout)
        if self._closed_by_caller:
            raise ConfigurationError(
                "this OutcomeWatcher was closed: start() it again, or wait on a running one"
            )
        if not self.running:
            # Never started, or its loop's task was cancelled with the loop; a lost
            # connection does not end the task (it reconnects), a close() does.
            self._task = None
            await self.start()
        waiter = _Waiter(target, asyncio.get_running_loop().create_future())
        self._waiters.setdefault(operation_id, []).append(waiter)
        if (key := decision_key_of(operation)) is not None:
            self._keys[operation_id] = key
        self._arrived.add(operation_id)
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), seconds)
        except TimeoutError:
            if waiter.latest_row is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.read.wait(), FIRST_READ_WITHIN)
            if waiter.future.done():
                return waiter.future.result()
            latest = waiter.latest
            if latest is not None:
                return latest
            cause = f" (last error: {type(self._last_error).__name__})" if self._last_error else ""
            raise TransientDatabaseError(
                f"no read of {display_operation_id(operation_id)} succeeded; the outcome is "
                f"unknown to this waiter, not to the runtime{cause}"
            ) from None
        finally:
            self._forget(operation_id, waiter)

    def _forget(self, operation_id: UUID, waiter: _Waiter) -> None:
        waiters = self._waiters.get(operation_id)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)
        if not waiters:
            del self._waiters[operation_id]
            self._rows.pop(operation_id, None)
            self._keys.pop(operation_id, None)
        if not waiter.future.done():
            waiter.future.cancel()

    # -- the loop ----------------------------------------------------------------------

    async def _run(self, ready: asyncio.Future[None]) -> None:
        backoff = Backoff(first=WATCHER_FIRST_RETRY_SECONDS, longest=WATCHER_LONGEST_RETRY_SECONDS)
        while not self._closed:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._url,
                    autocommit=True,
                    row_factory=psycopg.rows.dict_row,
                    application_name="outbox-outcome-watcher",
                    **self._connect_parameters,
                ) as connection:
                    await self._listen(connection)
                    if not ready.done():
                        ready.set_result(None)
                    backoff.reset()
                    self._last_error = None
                    await self._serve(connection)
            except asyncio.CancelledError:
                raise
            except (psycopg.Error, OSError, DatabaseError) as error:
                self._last_error = error
                self.listening = False
                if not ready.done():
                    ready.set_exception(_as_outbox_error(error))
                    return
                if isinstance(error, DatabaseError) and not isinstance(
                    error, TransientDatabaseError
                ):
                    # A refusal (a missing grant, an old schema) will not heal by
                    # retrying: every waiter hears it now rather than at its timeout.
                    self._fail_waiters(error)
                delay = backoff.next_delay()
                log_fields(
                    logger,
                    logging.WARNING,
                    "outcome_watcher.reconnecting",
                    "lost the database; reconnecting",
                    error=type(error).__name__,
                    retry_in=round(delay, 2),
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                self._wake.clear()

    def _fail_waiters(self, error: BaseException) -> None:
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.future.done():
                    waiter.future.set_exception(error)

    async def _listen(self, connection: psycopg.AsyncConnection[Any]) -> None:
        self.listening = False
        if self.listen:
            await (await AsyncStore.on(connection, require_transaction=False)).run(
                store.listen_operation_changes()
            )
            self.listening = True

    async def _serve(self, connection: psycopg.AsyncConnection[Any]) -> None:
        runner = await AsyncStore.on(connection, require_transaction=False)
        while not self._closed:
            self._wake.clear()
            if self._waiters:
                await self._read(runner)
            await self._wait_for_change(connection)

    async def _read(self, runner: AsyncStore) -> None:
        # Only what changed since the last read comes back: a wake-up costs the same
        # few rows whether 10 or 1,000 tool calls are waiting.
        ids = list(self._waiters)
        known = {
            operation_id: (row["row_version"] if (row := self._rows.get(operation_id)) else None)
            for operation_id in ids
        }
        arrived, self._arrived = self._arrived, set()
        try:
            rows = await runner.run(store.operation_outcomes_changed(known))
            seen = {row["id"] for row in rows} | set(self._rows)
            # A new waiter's operation the hot tables no longer hold: history's, if
            # anyone's (an archived row never changes, so it is asked for once).
            gone = {i: self._keys.get(i) for i in arrived if i not in seen}
            if gone:
                rows += [
                    {**row, "row_version": None}
                    for row in await runner.run(store.archived_outcomes(gone))
                ]
        except BaseException:
            self._arrived |= arrived  # answered by the read after the reconnect
            raise
        changed = set(arrived)
        for row in rows:
            self._rows[row["id"]] = row
            changed.add(row["id"])
        self.reads += 1
        for operation_id in changed:
            waiters = self._waiters.get(operation_id, [])
            row = self._rows.get(operation_id)
            status = None if row is None or row["state"] is None else status_of_row(row)
            outcome: Outcome | None = None
            for waiter in list(waiters):
                if waiter.future.done():
                    continue
                waiter.read.set()
                if row is None or row["state"] is None:
                    waiter.future.set_exception(
                        not_visible(operation_id)
                        if row is None
                        else archived_without_key(operation_id)
                    )
                    continue
                waiter.latest_row = row
                if status in waiter.target:
                    outcome = outcome or outcome_from_row(row)
                    waiter.future.set_result(outcome)

    async def _wait_for_change(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """Until a notification, a new waiter or the poll interval, whichever is first."""
        woken = asyncio.ensure_future(self._wake.wait())
        waits: set[asyncio.Future[Any]] = {woken}
        notified: asyncio.Task[int] | None = None
        if self.listening:
            notified = asyncio.create_task(self._next_notification(connection))
            waits.add(notified)
        try:
            await asyncio.wait(waits, timeout=self.poll_interval, return_when="FIRST_COMPLETED")
        finally:
            woken.cancel()
            if notified is not None and not notified.done():
                notified.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await notified
        if notified is not None and notified.done() and not notified.cancelled():
            self.notifications += notified.result()

    async def _next_notification(self, connection: psycopg.AsyncConnection[Any]) -> int:
        received = 0
        async for _ in connection.notifies(stop_after=1):
            received += 1
        return received


# --- one call -------------------------------------------------------------------------

# Per event loop (a watcher's connection and task belong to the loop that started
# them), then per database.
_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, OutcomeWatcher]] = (
    weakref.WeakKeyDictionary()
)


async def await_outcome(
    source: AsyncEngine | str | OutcomeWatcher,
    operation: UUID | RecordedDecision | Operation | Outcome,
    *,
    timeout: timedelta | float | None = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    until: Until = "attention",
) -> Outcome:
    """Wait until the decision is ``committed`` or ``rejected`` (``until="final"``), or
    also ``awaiting_approval`` / ``escalated`` (the default, ``"attention"``: those need a
    person, and a tool call should not sit waiting for one).

    ``source`` is the engine or URL of the database the decision was recorded in, or an
    :class:`OutcomeWatcher`; never the connection that recorded it (refused). For an
    engine or URL the process shares one watcher per event loop and database, closed by
    :func:`close_shared_watchers`. A timeout returns the latest outcome; waiting never
    changes the operation.
    """
    _refuse_connection(source)
    if isinstance(source, OutcomeWatcher):
        return await source.wait(operation, timeout=timeout, until=until)
    url = _url_of(source)
    watchers = _shared.setdefault(asyncio.get_running_loop(), {})
    watcher = watchers.get(url)
    if watcher is None or not watcher.running:
        watcher = watchers[url] = OutcomeWatcher(url)
        try:
            await watcher.start()
        except BaseException:
            watchers.pop(url, None)
            raise
    return await watcher.wait(operation, timeout=timeout, until=until)


async def close_shared_watchers() -> None:
    """Close the watchers :func:`await_outcome` opened for this event loop."""
    for watcher in _shared.pop(asyncio.get_running_loop(), {}).values():
        await watcher.close()


def await_outcome_sync(
    source: SAEngine | str,
    operation: UUID | RecordedDecision | Operation | Outcome,
    *,
    timeout: timedelta | float | None = DEFAULT_TIMEOUT,
    until: Until = "attention",
    poll_interval: float = DEFAULT_POLL_INTERVAL,
) -> Outcome:
    """The blocking twin of :func:`await_outcome`, on a connection of its own for the
    length of the call (LISTEN, then read; re-read on a notification or every
    ``poll_interval``)."""
    _refuse_connection(source)
    operation_id = awaited_id(operation)
    target = statuses_until(until)
    seconds = _seconds(timeout)
    deadline = None if seconds is None else time.monotonic() + seconds
    with psycopg.connect(
        _url_of(source),
        autocommit=True,
        row_factory=psycopg.rows.dict_row,
        application_name="outbox-outcome-wait",
        **command_parameters(),
    ) as connection:
        runner = Store(connection, require_transaction=False)
        runner.run(store.listen_operation_changes())
        while True:
            outcome = single_outcome(
                runner.run(outcome_rows(operation_id, decision_key_of(operation))), operation_id
            )
            remaining = None if deadline is None else deadline - time.monotonic()
            if outcome.status in target or (remaining is not None and remaining <= 0):
                return outcome
            wait = poll_interval if remaining is None else min(poll_interval, remaining)
            for _ in connection.notifies(timeout=wait, stop_after=1):
                pass
