"""The consumer's side of Postgres: one pool, transactions under a deadline, and the
policy's decisions as store plans."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import psycopg

from consumer.policy import Transition
from consumer.telemetry import log
from outbox import lifecycle, schema, store
from outbox.bounds import bind as bind_json_bounds
from outbox.bounds import unreadable_reason
from outbox.connections import DatabaseBounds, SessionPool
from outbox.daemon import is_transient_database_error
from outbox.failover import ServerTracker
from outbox.metrics import ConsumerMetrics
from outbox.models import Operation
from outbox.pacing import AIMDLimit
from outbox.settings import Settings
from outbox.states import OperationState
from outbox.store import AsyncStore, Plan

T = TypeVar("T")

# The name this process gives its database sessions and its broker connection.
APPLICATION_NAME = "outbox-consumer"


WORK_CONNECTIONS = 16
"""The most connections a consumer's deliveries write on at once (the pool adds six for
the reconciler and the loops beside): the claims and committed outcomes of a burst share
one transaction each, so more buys nothing but a share of Postgres's max_connections."""

MOST_BURST_OPERATIONS = 256
"""The most operations a burst of claims or of outcomes takes into one transaction when
messages carry several: measured (docs/benchmarks.md, "2026-12-05, 14:25 to 14:56"), letting a
burst take 256 of the chunks' operations instead of 64 raised the default's drain by a
sixth for a tenth less CPU an operation, and 512 or 1,024 bought nothing more."""


class Database:
    """The pool the worker and the reconciler share, what they read once from it, and
    how much work the consumer takes on while it keeps up (:attr:`pacing`)."""

    def __init__(
        self,
        settings: Settings,
        metrics: ConsumerMetrics | None = None,
        tracker: ServerTracker | None = None,
        on_lock_wait: Callable[[tuple[store.LockHolder, ...]], None] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.tracker = tracker
        self.bounds = DatabaseBounds.from_settings(settings)
        self.fingerprint_key: str | None = None
        """Read with the first transaction that needs it: spans show keyed short
        fingerprints."""
        self.sessions = SessionPool(
            self._connect,
            transaction_seconds=self.bounds.transaction,
            hard_seconds=self.bounds.hard_transaction,
            on_slow=self._slow,
            on_lock_wait=on_lock_wait,
            # A burst's claim and its outcomes each take one transaction, and the
            # reconciler one more: a few connections stay open, more open on demand, at
            # most as many as the work in hand needs up to WORK_CONNECTIONS (a prefetch
            # of 64 chunks would otherwise hold 70 connections per consumer process, and
            # three consumers a default Postgres's 100).
            idle=4,
            most=min(settings.prefetch, WORK_CONNECTIONS) + 6,
        )
        self.limit_changed = asyncio.Event()
        """Set when :attr:`pacing` moved: the consumer applies it as its prefetch."""
        # A transaction that takes half its soft deadline is a database falling behind:
        # narrow before the deadlines start cutting.
        self.pacing = AIMDLimit(
            most=settings.prefetch,
            slow_after=self.bounds.transaction / 2,
            on_change=self._limit_moved,
        )
        self._limit_moved(self.pacing.limit)

    def in_hand_limit(self) -> int:
        """The most operations the consumer may hold in hand: its limit in messages,
        each up to ``OUTBOX_MESSAGE_OPERATIONS`` operations."""
        return self.pacing.limit * self.settings.message_operations

    def burst_limit(self) -> int:
        """The most deliveries a burst of claims or of outcomes takes into one
        transaction: what is in hand (:meth:`in_hand_limit`), up to
        :data:`MOST_BURST_OPERATIONS` but never fewer than the limit itself. A narrowed
        limit narrows the bursts."""
        return min(self.in_hand_limit(), max(self.pacing.limit, MOST_BURST_OPERATIONS))

    def _slow(self, verdict: str) -> None:
        if self.metrics is not None:
            self.metrics.slow_transactions.labels(verdict).inc()

    def _limit_moved(self, limit: int) -> None:
        if self.metrics is not None:
            self.metrics.limit.labels("prefetch").set(limit)
        self.limit_changed.set()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        connection = await psycopg.AsyncConnection.connect(
            self.settings.libpq_url,
            application_name=APPLICATION_NAME,
            **self.bounds.libpq_parameters(),
        )
        bind_json_bounds(connection)
        if self.tracker is not None:
            self.tracker.observe(connection)
        return connection

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A transaction whose connection is cut past its deadline, so a silent link
        never holds an operation's row beyond the lease. The lifecycle lines its plans
        emit are written once it commits, and dropped if it rolls back: a line never
        reports a move the database did not keep."""
        async with self._paced(self.sessions.transaction()) as connection:
            yield connection

    @contextlib.asynccontextmanager
    async def _paced(
        self, session: contextlib.AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        began = time.monotonic()
        try:
            with lifecycle.held() as lines:
                async with session as connection:
                    yield connection
        except Exception as error:
            if is_transient_database_error(error):
                self.pacing.overloaded()
            raise
        self.pacing.observe(time.monotonic() - began)
        lifecycle.write_all(lines)

    async def run(self, plan: Plan[T]) -> T:
        """``plan`` in a transaction of its own."""
        async with self.transaction() as connection:
            return await (await AsyncStore.on(connection)).run(plan)

    async def run_alone(self, plan: Plan[T]) -> T:
        """``plan``, which sends one statement, as a transaction of its own in autocommit:
        one round trip where :meth:`run` takes three (BEGIN, the statement, COMMIT), under
        the same deadline and pacing. A plan that tries a second statement raises before
        sending it."""
        async with self._paced(self.sessions.statement()) as connection:
            return await (await AsyncStore.alone(connection)).run(plan)

    async def remember_fingerprint_key(self, runner: AsyncStore) -> None:
        if self.fingerprint_key is None:
            self.fingerprint_key = await runner.run(store.fingerprint_key())

    def schema_present(self) -> bool:
        """Whether the database has the schema this consumer reads (blocking)."""
        with psycopg.connect(
            self.settings.libpq_url,
            application_name=APPLICATION_NAME,
            **self.bounds.libpq_parameters(),
        ) as connection:
            # An older schema lacks what this consumer reads (outbox_deployment): that
            # too is "run outbox migrate".
            return schema.schema_is_current(connection)

    async def close(self) -> None:
        await self.sessions.close()


def transition_plan(operation: Operation, move: Transition) -> Plan[Operation]:
    """``move`` through the store, under the fencing token ``operation`` was read with:
    the store raises :class:`~outbox.errors.IllegalTransition` (or its ``LeaseLost``)
    and changes nothing when another process moved it first. A move with a ``then``
    writes that escalation next, in the same plan and so the same transaction: nobody
    sees the operation between the two."""
    moved = yield from store.transition(
        operation.id,
        source=move.source,
        target=move.target,
        lease_token=operation.lease_token,
        event=move.event,
        attributes=move.attributes,
        provider_reference=move.provider_reference,
        result=move.result,
        error_class=move.error_class,
        delay=move.delay,
        reconcile_attempt=move.reconcile_attempt,
        effect_disproved=move.effect_disproved,
        waiting=move.waiting,
        attempt_refunded=move.attempt_refunded,
    )
    if move.then is None:
        return moved
    return (yield from transition_plan(moved, move.then.transition))


async def quarantine_unreadable(
    runner: AsyncStore, metrics: ConsumerMetrics, operation: Operation, tool: str
) -> None:
    """Escalate an operation whose stored input no reader may parse (a row from before
    the database bounded inputs, or written around the bounds): it is never executed and
    cannot be looked up, so a person ends it. Counted and logged by id once the move is
    written; raises :class:`~outbox.errors.IllegalTransition` if another process moved
    it first."""
    why = unreadable_reason(operation.input) or "malformed"
    await runner.run(
        store.transition(
            operation.id,
            source=operation.state,
            target=OperationState.ESCALATED,
            attributes={"reason": "unreadable", "check": why},
            error_class="unreadable",
        )
    )
    metrics.unreadable.labels(tool, "input").inc()
    metrics.escalations.labels(tool, "unreadable").inc()
    log(
        logging.ERROR,
        "consumer.unreadable",
        "the stored input cannot be read; escalated",
        id=operation.display_id,
        tool=tool,
        why=why,
    )
