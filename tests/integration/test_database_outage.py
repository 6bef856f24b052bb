"""A Postgres outage mid-stream costs seconds, never a dead letter nor a person's time.

Postgres is stopped (a restart, a failover's switch) while messages keep arriving: each
delivery the consumer cannot claim stays unacknowledged in its hand and is tried again
with backoff. Sent back to the queue instead, it would come back about once a second and
the quorum queue's delivery limit would dead-letter it within seconds, leaving its
decision parked until the stale sweep ten minutes later. Once the server is back (same
port), every decision settles within 30 s, and nothing was dead-lettered.

The server is a private one (tests/support/private_postgres.py): the shared one is never
stopped. The messages are published straight to the queue while the server is down, as
a dispatcher's would arrive from before the outage, and their outbox rows are marked
published (a dead-lettered one would wait for the stale sweep); the dispatcher runs too,
reconnecting through the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aio_pika
import pytest
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.pool import NullPool

from dispatcher.daemon import Dispatcher
from outbox import OperationState, Registry, Settings, record_decision
from outbox.broker import OperationMessage
from outbox.sandbox.scratch import ScratchDatabase
from outbox.settings import sqlalchemy_url

from support import private_postgres
from support.consume_helpers import in_state, operation, publish_raw, running_consumer
from support.dispatch_helpers import counter_value
from support.private_postgres import PrivatePostgres
from support.sample_tools import Ledger
from support.waiting import eventually

S = OperationState
DECISIONS = 12
SETTLED_WITHIN_SECONDS = 30.0

pytestmark = pytest.mark.skipif(
    not private_postgres.installed(), reason="needs a Postgres installation (initdb, pg_ctl)"
)


@pytest.fixture
def server() -> Iterator[PrivatePostgres]:
    with private_postgres.private_postgres() as server:
        yield server


@pytest.fixture
def outage_database(server: PrivatePostgres) -> Iterator[str]:
    with ScratchDatabase.unique(server.url(), "outbox_outage") as database:
        yield database.url


@contextlib.asynccontextmanager
async def dispatcher_started_in_the_outage(settings: Settings) -> AsyncIterator[Dispatcher]:
    """A dispatcher started while the database is away: it waits for it, and is not
    ready (nor waited for) until it is back."""
    dispatcher = Dispatcher(settings)
    task = asyncio.create_task(dispatcher.run())
    try:
        yield dispatcher
    finally:
        dispatcher.stop()
        await asyncio.wait_for(task, timeout=30)


async def dead_letters(amqp_url: str, queue: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


def envelopes(database_url: str, registry: Registry) -> list[tuple[Any, OperationMessage, str]]:
    engine = sa.create_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    try:
        recorded = []
        for n in range(DECISIONS):
            with engine.begin() as connection:
                recorded.append(
                    record_decision(
                        connection,
                        registry,
                        "send_refund",
                        {"payment_id": f"pay_{n}", "amount_cents": 100 + n},
                        run_id="outage",
                    ).operation
                )
        # As the dispatcher left them before the outage: published, in the queue.
        with engine.begin() as connection:
            connection.execute(sa.text("UPDATE outbox SET published_at = now()"))
    finally:
        engine.dispose()
    return [
        (
            op.id,
            OperationMessage(
                operation_id=op.id,
                outbox_id=n + 1,
                tool=op.tool_name,
                tool_version=op.tool_version,
                input_fingerprint=op.input_fingerprint,
            ),
            f"{op.tool_name}.v{op.tool_version}",
        )
        for n, op in enumerate(recorded)
    ]


@pytest.mark.parametrize(
    "outage_seconds",
    [
        # The outage, the settling bound and a server's initdb, start and stop.
        pytest.param(15, marks=pytest.mark.timeout(15 + SETTLED_WITHIN_SECONDS + 75)),
        pytest.param(60, marks=pytest.mark.timeout(60 + SETTLED_WITHIN_SECONDS + 75)),
    ],
)
async def test_a_postgres_outage_dead_letters_nothing_and_settles_within_30_s_of_its_end(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    server: PrivatePostgres,
    outage_database: str,
    outage_seconds: int,
) -> None:
    daemon_settings = settings.model_copy(
        update={"database_url": SecretStr(outage_database), "reconcile_interval": 0.1}
    )
    amqp_url = settings.amqp_url.get_secret_value()
    stream = await asyncio.to_thread(envelopes, outage_database, registry)

    async with running_consumer(daemon_settings, registry) as consumer:
        await asyncio.to_thread(server.stop)
        stopped_at = time.monotonic()
        async with dispatcher_started_in_the_outage(daemon_settings):
            # The stream arrives while the server is down: half at once, the rest spread
            # over the outage.
            for n, (_, envelope, routing_key) in enumerate(stream):
                await publish_raw(
                    amqp_url, settings.exchange, envelope.model_dump_json().encode(), routing_key
                )
                if n >= DECISIONS // 2:
                    await asyncio.sleep(outage_seconds / DECISIONS)
            left = outage_seconds - (time.monotonic() - stopped_at)
            await asyncio.sleep(max(0.0, left))  # the outage itself: nothing to wait for
            await asyncio.to_thread(server.start)

            # One deadline from the return for all of them, not one per decision.
            checks = [
                in_state(outage_database, operation_id, S.COMMITTED)
                for operation_id, _, _ in stream
            ]

            async def all_committed() -> bool:
                return all([await check() for check in checks])

            await eventually(
                all_committed,
                within=SETTLED_WITHIN_SECONDS,
                what=f"every decision to settle within {SETTLED_WITHIN_SECONDS:g} s of the "
                f"database's return after a {outage_seconds} s outage",
            )

        assert await dead_letters(amqp_url, settings.dead_letter_queue) == 0
        assert counter_value(consumer, "outbox_consumer_deliveries_held_total") >= 1
        assert (
            counter_value(consumer, "outbox_consumer_deliveries_total", result="retry_later") == 0
        )
    assert sorted(ledger.calls) == sorted(str(operation_id) for operation_id, _, _ in stream)
    assert all(
        operation(outage_database, operation_id).attempts == 1 for operation_id, _, _ in stream
    )
