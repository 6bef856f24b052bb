"""What Prometheus sees of the state of the system: the gauges on each daemon's
/metrics, read over HTTP. Each gauge is refreshed on a loop of its own, so it reports
the truth while the daemon is cut off from the broker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import psycopg
from pydantic import SecretStr

from consumer.worker import Consumer
from dispatcher.daemon import Dispatcher
from outbox import OperationState, Registry, Settings
from outbox import store as outbox_store
from outbox.broker import Topology, delete_topology
from outbox.sql import QUERIES
from outbox.states import EventName
from outbox.store import Store

from support.consume_helpers import in_state, running_consumer
from support.dispatch_helpers import record_many, record_one, running_dispatcher
from support.ops_helpers import Ops
from support.ports import closed_port
from support.scraping import Samples, labelled, scrape, value
from support.waiting import eventually

S = OperationState
# Closed sets only: a column is one of the stored values a reader may find unreadable.
ALLOWED_LABELS = {
    "tool",
    "state",
    "outcome",
    "reason",
    "result",
    "peer",
    "check",
    "queue",
    "column",
    "verdict",
    "limit",
    "provider",
    "le",
}


def operations_gauge(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["state"]: found
        for labels, found in labelled(samples, "outbox_operations").items()
    }


def cut_off_from_the_broker(settings: Settings) -> Settings:
    """The same settings with a broker address nothing listens on."""
    return settings.model_copy(
        update={"amqp_url": SecretStr(f"amqp://guest:guest@127.0.0.1:{closed_port()}/")}
    )


@asynccontextmanager
async def started(daemon: Dispatcher | Consumer) -> AsyncIterator[None]:
    """The daemon running on this loop, whether or not it ever reaches its broker."""
    task = asyncio.create_task(daemon.run())
    try:
        yield
    finally:
        daemon.stop()
        await asyncio.wait_for(task, timeout=20)


async def scraped(daemon: Dispatcher | Consumer) -> Samples:
    return await asyncio.to_thread(scrape, daemon.metrics_port)


def admin(database_url: str, statement: str, *params: Any) -> None:
    """As the test's superuser, triggers off: a row as time and other processes left it."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(statement, params or None)
        connection.commit()


async def test_the_dispatcher_exports_operations_by_state_with_zeros(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 3)
    async with running_dispatcher(settings) as dispatcher:
        # The gauge loop refreshes them as it starts; no consumer, so all stay prepared.
        async def counted() -> bool:
            return operations_gauge(await scraped(dispatcher)).get("prepared") == 3.0

        await eventually(counted, within=10, what="3 prepared operations in the gauge")
        by_state = operations_gauge(await scraped(dispatcher))

    # Every state is exported, so an alert on one of them sees 0, not "no data".
    assert by_state == {str(state): (3.0 if state is S.PREPARED else 0.0) for state in S}


async def test_a_dispatcher_that_cannot_reach_the_broker_reports_the_real_backlog(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 3)
    dispatcher = Dispatcher(cut_off_from_the_broker(settings))

    async with started(dispatcher):

        async def reported() -> bool:
            return value(await scraped(dispatcher), "outbox_dispatcher_backlog_rows") == 3.0

        await eventually(reported, within=15, what="the backlog of 3 rows on /metrics")
        samples = await scraped(dispatcher)

    # The backlog is read from Postgres, not in a session that needs the broker too:
    # what OutboxBacklogStale needs in exactly the outage it is there for.
    age = value(samples, "outbox_dispatcher_oldest_pending_age_seconds")
    assert age is not None
    assert age > 0
    assert operations_gauge(samples)["prepared"] == 3.0
    assert value(samples, "outbox_broker_connected") == 0.0
    assert not dispatcher.healthy()


async def test_the_dispatcher_reports_the_depth_of_the_queue_and_of_the_dead_letter_queue(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 3)
    async with running_dispatcher(settings) as dispatcher:

        async def depths(operations: float, dead: float) -> bool:
            samples = await scraped(dispatcher)
            return (
                value(samples, "outbox_queue_messages", queue="operations") == operations
                and value(samples, "outbox_queue_messages", queue="dead_letter") == dead
            )

        # No consumer: the three published messages wait in the queue.
        await eventually(lambda: depths(3, 0), within=15, what="3 messages in the queue")
        # One message the broker dead-letters (as after the delivery limit).
        connection = await aio_pika.connect(amqp_server_url)
        async with connection:
            channel = await connection.channel()
            dead = await channel.get_exchange(settings.dead_letter_exchange)
            await dead.publish(aio_pika.Message(b"{}"), routing_key="send_refund.v1")
        await eventually(lambda: depths(3, 1), within=15, what="1 message in the DLQ")
        connected = value(await scraped(dispatcher), "outbox_broker_connected")

    assert connected == 1.0


async def test_the_dispatcher_reports_each_tool_queue_by_its_name(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    pay = f"{settings.queue}.pay"
    grouped = settings.model_copy(update={"tool_queues": f"{pay}=send_refund"})
    await asyncio.to_thread(record_many, database_url, registry, 3)
    try:
        async with running_dispatcher(grouped) as dispatcher:

            async def depths() -> bool:
                samples = await scraped(dispatcher)
                return (
                    value(samples, "outbox_queue_messages", queue=pay) == 3
                    and value(samples, "outbox_queue_messages", queue="operations") == 0
                )

            # The refunds go to their group's queue, and its gauge counts them.
            await eventually(depths, within=15, what=f"3 messages in {pay}, none elsewhere")
    finally:
        await delete_topology(amqp_server_url, Topology.from_settings(grouped))


async def test_a_consumer_cut_off_from_the_broker_reports_what_waits_to_execute(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    ready = record_one(database_url, registry)
    awaiting = record_one(database_url, registry, amount_cents=60_000)
    backing_off = record_one(database_url, registry)
    unpublished = record_one(database_url, registry)
    admin(
        database_url, "UPDATE outbox SET published_at = now() WHERE operation_id <> %s", unpublished
    )
    # Ready (published, due, no approval needed) for an hour; the others longer, but
    # each for a reason that is not the consumers': an approval, a backoff, the publish.
    for operation_id, waited in (
        (ready, "1 hour"),
        (awaiting, "2 hours"),
        (unpublished, "3 hours"),
    ):
        admin(
            database_url,
            "UPDATE operations SET created_at = now() - %s::interval, "
            "next_attempt_at = now() - %s::interval WHERE id = %s",
            waited,
            waited,
            operation_id,
        )
    admin(
        database_url,
        "UPDATE operations SET next_attempt_at = now() + interval '1 hour' WHERE id = %s",
        backing_off,
    )
    with psycopg.connect(database_url) as connection:
        store = Store(connection)
        operation = store.run(outbox_store.get_operation(awaiting))
        store.run(outbox_store.append_event(operation, EventName.APPROVAL_REQUIRED, {}))
        connection.commit()
    consumer = Consumer(cut_off_from_the_broker(settings), registry)

    async with started(consumer):

        async def reported() -> bool:
            samples = await scraped(consumer)
            return value(samples, "outbox_operations_awaiting_approval") == 1.0

        await eventually(reported, within=15, what="1 operation awaiting approval on /metrics")
        samples = await scraped(consumer)

    age = value(samples, "outbox_oldest_ready_operation_age_seconds")
    assert age is not None
    assert 3600 <= age < 7200, "the ready one, not the awaiting or unpublished ones"
    assert value(samples, "outbox_broker_connected") == 0.0


async def test_the_consumer_exports_attempts_and_deliveries(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    operation_id = record_one(database_url, registry)
    async with (
        running_dispatcher(settings) as dispatcher,
        running_consumer(settings, registry) as consumer,
    ):
        await eventually(
            in_state(database_url, operation_id, S.COMMITTED), within=30, what="committed"
        )
        consumer_samples = await scraped(consumer)
        # Refreshed on a timer in the daemon; called here so the test need not wait 5 s.
        async with await psycopg.AsyncConnection.connect(database_url) as connection:
            await dispatcher.refresh_backlog(connection)
        dispatcher_samples = await scraped(dispatcher)

    assert (
        value(
            consumer_samples,
            "outbox_effect_attempts_total",
            tool="send_refund",
            outcome="committed",
        )
        == 1.0
    )
    assert value(consumer_samples, "outbox_consumer_deliveries_total", result="processed") == 1.0
    assert value(consumer_samples, "outbox_oldest_ready_operation_age_seconds") is not None
    assert operations_gauge(dispatcher_samples)["committed"] == 1.0
    assert operations_gauge(dispatcher_samples)["prepared"] == 0.0
    # Never an id among the labels of our metrics, on either daemon.
    for samples in (consumer_samples, dispatcher_samples):
        for name, label_pairs in samples:
            if name.startswith("outbox_") and name != "outbox_build_info":
                assert {key for key, _ in label_pairs} <= ALLOWED_LABELS, name


def test_the_gauge_counts_what_is_open_exactly_and_settled_from_the_statistics(
    database_url: str, registry: Registry
) -> None:
    # The gauge's pass must cost what is open, not the history: the open states come
    # from the partial index that holds only them, and committed and rejected, which
    # only grow, from the table's statistics once it is large (here forced with a
    # threshold of 0; the estimate is exact: ANALYZE reads a small table whole).
    ops = Ops(database_url, registry)
    for _ in range(4):
        ops.at(S.COMMITTED)
    # Twice: a value ANALYZE's sample holds once is not among the common ones.
    for _ in range(2):
        ops.at(S.REJECTED)
    ops.at(S.ESCALATED)
    ops.new()
    with psycopg.connect(database_url, autocommit=True) as connection:
        runner = Store(connection, require_transaction=False)
        exact = runner.run(outbox_store.operations_by_state())
        before = runner.run(outbox_store.operations_by_state(exact_below=0))
        connection.execute("ANALYZE operations")
        after = runner.run(outbox_store.operations_by_state(exact_below=0))
        connection.execute("SET enable_seqscan = off")
        plan = "\n".join(
            row[0]
            for row in connection.execute(
                "EXPLAIN " + QUERIES["operations_by_state"].sql
            ).fetchall()
        )

    open_counts = {S.PREPARED: 1, S.ESCALATED: 1, S.IN_FLIGHT: 0, S.OUTCOME_UNKNOWN: 0}
    assert exact == {**open_counts, S.COMMITTED: 4, S.REJECTED: 2}
    assert before == {**open_counts, S.COMMITTED: 0, S.REJECTED: 0}
    assert after == {**open_counts, S.COMMITTED: 4, S.REJECTED: 2}
    assert "operations_state_next_attempt" in plan, plan


def test_the_estimate_finds_its_statistics_by_the_catalogs_indexes(database_url: str) -> None:
    # pg_stats is a view over pg_class, pg_attribute and pg_statistic: told which table
    # only through a join, it read the whole of pg_class or pg_attribute (a hundred
    # pages and more) on every pass of every dispatcher: the catalog's cost, not the
    # history's. Given the name, it probes their indexes.
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute("ANALYZE operations")
        plan = "\n".join(
            row[0]
            for row in connection.execute(
                "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) "
                + QUERIES["operations_by_state"].sql
            ).fetchall()
        )

    assert "pg_class_relname_nsp_index" in plan, plan
    read = plan.split("Buffers: shared hit=", 1)[1].split()[0]
    assert int(read) < 60, plan
