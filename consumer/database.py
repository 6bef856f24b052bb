"""The consumer's side of Postgres: one pool, transactions under a deadline, and the
policy's decisions as store plans."""

from __future__ import annotations

import contextlib
from typing import TypeVar

import psycopg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from consumer.policy import Transition
from outbox import store
from outbox.connections import DatabaseBounds, bounded_transaction
from outbox.models import Operation
from outbox.settings import Settings
from outbox.store import AsyncStore, Plan

T = TypeVar("T")

# The name this process gives its database sessions and its broker connection.
APPLICATION_NAME = "outbox-consumer"


class Database:
    """The pool the worker and the reconciler share, and what they read once from it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bounds = DatabaseBounds.from_settings(settings)
        self.fingerprint_key: str | None = None
        """Read with the first transaction that needs it: spans show keyed short
        fingerprints."""
        self._engine: AsyncEngine | None = None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            # No pre-ping: it is a round trip per checkout with no deadline of its own. A
            # dead pooled connection fails its transaction's first statement instead (a
            # transient error: the delivery comes back), and SQLAlchemy discards the pool.
            self._engine = create_async_engine(
                self.settings.sqlalchemy_url,
                pool_size=self.settings.prefetch + 2,
                max_overflow=4,
                connect_args={
                    "application_name": APPLICATION_NAME,
                    **self.bounds.libpq_parameters(),
                },
            )
        return self._engine

    def transaction(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """A transaction whose connection is cut past its deadline, so a silent link
        never holds an operation's row beyond the lease."""
        return bounded_transaction(self.engine, self.bounds.transaction)

    async def run(self, plan: Plan[T]) -> T:
        """``plan`` in a transaction of its own."""
        async with self.transaction() as connection:
            return await (await AsyncStore.on(connection)).run(plan)

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
            return store.schema_is_current(connection)

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None


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
    )
    if move.then is None:
        return moved
    return (yield from transition_plan(moved, move.then.transition))
