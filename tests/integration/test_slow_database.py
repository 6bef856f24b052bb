"""A database link slower than the transaction deadline makes the runtime slower, never
hands a decision to a person.

Only the consumer reaches Postgres through a TCP proxy, and the proxy holds every chunk
for twice the hard transaction deadline: no consumer transaction, nor a connect, can
finish while the delay lasts, so every delivery meets our own timeout. The stale sweep
(a reconciler of its own) and the dispatcher reach Postgres directly, so the sweep runs
on time and queues each operation again every stale period. The delay holds until every
operation was queued again more than ``undeliverable_after_requeues`` times (or left
``prepared``): the code before issue 22 escalated each one as ``undeliverable`` at its
third requeue, a consumer alive and its messages in the queue. Once the delay lifts,
every decision commits, once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest
from pydantic import SecretStr

from consumer.worker import Consumer
from harness.proxy import TcpProxy, url_through
from outbox import OperationState, Registry, Settings

from support.consume_helpers import running_consumer
from support.db_helpers import execute_admin
from support.dispatch_helpers import counter_value, record_many, running_dispatcher
from support.sample_tools import Ledger
from support.waiting import eventually

S = OperationState
DECISIONS = 6
REQUEUES = 3
STALE_AFTER = timedelta(seconds=1)
# Soft deadline 0.5 s, hard 1 s (lease margin 2 s); every chunk held 2 s, so one round
# trip takes 4 s: past both deadlines, the liveness probe's 2 s and the connect timeout.
SOFT_DEADLINE_SECONDS = 0.5
LEASE_MARGIN_SECONDS = 2.0
CHUNK_DELAY_SECONDS = 2.0
SETTLED_WITHIN_SECONDS = 30.0


@contextlib.asynccontextmanager
async def stale_sweep(settings: Settings, registry: Registry) -> AsyncIterator[None]:
    """The reconciler's loop (stale sweep included) on a direct link, beside the
    consumer under test."""
    sweeper = Consumer(settings, registry)
    task = asyncio.create_task(sweeper.reconciler.run())
    try:
        yield
    finally:
        sweeper.reconciler.stop()
        await asyncio.wait_for(task, timeout=20)
        await sweeper.close()


def evidence(database_url: str, operation_ids: list[UUID]) -> dict[UUID, tuple[str, int]]:
    """Each operation's state and how often the stale sweep queued it again."""
    rows = execute_admin(
        database_url,
        "SELECT o.id, o.state, count(e.id) FROM operations o "
        "LEFT JOIN operation_events e ON e.operation_id = o.id "
        "AND e.name = 'operation.requeued' AND e.attributes ->> 'reason' = 'no_delivery' "
        "WHERE o.id = ANY(%s) GROUP BY o.id, o.state",
        (operation_ids,),
    )
    return {row[0]: (row[1], int(row[2])) for row in rows}


def undeliverable_escalations(
    database_url: str, operation_ids: list[UUID]
) -> dict[UUID, dict[str, Any]]:
    rows = execute_admin(
        database_url,
        "SELECT operation_id, attributes FROM operation_events "
        "WHERE operation_id = ANY(%s) AND name = 'operation.escalated' "
        "AND attributes ->> 'reason' = 'undeliverable'",
        (operation_ids,),
    )
    return {row[0]: row[1] for row in rows}


@pytest.mark.timeout(120)
async def test_a_database_link_slower_than_the_deadline_escalates_nothing_and_all_commit(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    database_url: str,
    database_proxy: TcpProxy,
) -> None:
    daemon_settings = settings.model_copy(
        update={
            "lease_margin": LEASE_MARGIN_SECONDS,
            "db_transaction_timeout": SOFT_DEADLINE_SECONDS,
            "db_connect_timeout": 2,
            "requeue_stale_after": STALE_AFTER,
            "undeliverable_after_requeues": REQUEUES,
            "reconcile_interval": 0.05,
        }
    )
    consumer_settings = daemon_settings.model_copy(
        update={
            "database_url": SecretStr(
                url_through(settings.database_url.get_secret_value(), database_proxy.port)
            )
        }
    )

    async with (
        running_dispatcher(daemon_settings),
        running_consumer(consumer_settings, registry) as consumer,
        stale_sweep(daemon_settings, registry),
    ):
        database_proxy.delay(CHUNK_DELAY_SECONDS)
        await asyncio.to_thread(
            record_many, database_url, registry, DECISIONS, run_id="slow_database"
        )
        # The test's own database: every operation in it is one of these decisions.
        operation_ids = [
            row[0]
            for row in await asyncio.to_thread(
                execute_admin, database_url, "SELECT id FROM operations"
            )
        ]

        async def past_the_requeue_limit() -> bool:
            # Queued again once more than the limit, or taken out of `prepared` (the
            # code before issue 22 escalated it at the limit's sweep).
            seen = await asyncio.to_thread(evidence, database_url, operation_ids)
            return len(seen) == DECISIONS and all(
                state != S.PREPARED.value or requeues > REQUEUES
                for state, requeues in seen.values()
            )

        await eventually(
            past_the_requeue_limit,
            within=30,
            what=f"every operation to be queued again more than {REQUEUES} times while the "
            "database link is slow",
        )
        during_the_delay = await asyncio.to_thread(evidence, database_url, operation_ids)
        effects_during_the_delay = list(ledger.calls)
        database_proxy.restore()

        # The path was exercised: the sweep queued each operation again at least as often
        # as the undeliverable limit while no consumer transaction could finish.
        assert all(requeues >= REQUEUES for _, requeues in during_the_delay.values()), (
            during_the_delay
        )
        assert await asyncio.to_thread(undeliverable_escalations, database_url, operation_ids) == {}
        # Nor did any consumer transaction finish meanwhile: a claim commits before its
        # effect runs, and none ran.
        assert effects_during_the_delay == []

        async def all_committed() -> bool:
            seen = await asyncio.to_thread(evidence, database_url, operation_ids)
            return all(state == S.COMMITTED.value for state, _ in seen.values())

        await eventually(
            all_committed,
            within=SETTLED_WITHIN_SECONDS,
            what="every decision to commit once the delay lifts",
        )

        # The deliveries met our own timeouts and stayed in the consumer's hand; none went
        # back to the queue to count toward its delivery limit.
        assert counter_value(consumer, "outbox_consumer_deliveries_held_total") >= 1
        assert (
            counter_value(consumer, "outbox_consumer_deliveries_total", result="retry_later") == 0
        )
    assert sorted(ledger.calls) == sorted(str(operation_id) for operation_id in operation_ids)
