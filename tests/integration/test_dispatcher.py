from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.daemon import Dispatcher
from outbox import Registry, Settings, record_decision
from outbox.broker import CONTENT_TYPE, MESSAGE_TYPE, Topology
from outbox.sql import QUERIES

from support.broker_helpers import read_all
from support.db_helpers import execute_admin
from support.dispatch_helpers import all_published, counter_value, record_many, running_dispatcher
from support.waiting import eventually

REFUND = {"payment_id": "pay_canary_5e1f", "amount_cents": 4200, "reason": "canary-text-91ab"}


async def test_n_committed_rows_become_exactly_n_confirmed_messages(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    ids = await asyncio.to_thread(record_many, database_url, registry, 450)
    dispatcher = Dispatcher(settings)

    report = await dispatcher.drain()
    messages = await read_all(amqp_server_url, settings.queue, expect=450)

    assert (report.published, report.failed) == (450, 0)
    assert sorted(m.body.outbox_id for m in messages) == ids
    rows = execute_admin(
        database_url,
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND publish_attempts = 1",
    )
    assert rows == [(450,)]
    assert counter_value(dispatcher, "outbox_dispatcher_published_total", tool="send_refund") == 450


async def test_a_drain_with_nothing_to_publish_costs_one_claim(settings: Settings) -> None:
    # Every lane claiming at each wake made most claims at low rates find nothing.
    dispatcher = Dispatcher(settings.model_copy(update={"dispatch_lanes": 4}))

    report = await dispatcher.drain()

    assert (report.published, report.failed) == (0, 0)
    assert counter_value(dispatcher, "outbox_dispatcher_empty_claims_total") == 1


async def test_messages_are_thin_persistent_and_carry_no_input(
    settings: Settings, registry: Registry, engine: Any, database_url: str, amqp_server_url: str
) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with engine.begin() as connection:
        recorded = record_decision(
            connection, registry, "send_refund", REFUND, run_id="run_7", traceparent=traceparent
        )
    operation = recorded.operation

    await Dispatcher(settings).drain()
    (received,) = await read_all(amqp_server_url, settings.queue, expect=1)

    message = received.message
    assert received.body.operation_id == operation.id
    assert received.body.tool == "send_refund"
    assert received.body.tool_version == 1
    assert received.body.input_fingerprint == operation.input_fingerprint
    assert message.content_type == CONTENT_TYPE
    assert message.type == MESSAGE_TYPE
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.message_id == f"outbox-{received.body.outbox_id}"
    assert message.correlation_id == str(operation.id)
    assert message.routing_key == "send_refund.v1"
    # The broker adds its own x- headers (x-delivery-count on quorum queues).
    assert {k: v for k, v in message.headers.items() if not k.startswith("x-")} == {
        "traceparent": traceparent
    }
    raw = message.body.decode() + repr(message.headers)
    # Neither input values nor input field names travel: the body is ids and a hash.
    for canary in ("pay_canary_5e1f", "canary-text-91ab", "amount_cents", "payment_id"):
        assert canary not in raw


async def test_a_rolled_back_row_is_never_published(
    settings: Settings, registry: Registry, engine: Any, amqp_server_url: str
) -> None:
    with engine.connect() as connection:
        record_decision(connection, registry, "send_refund", REFUND, run_id="rolled_back")
        connection.rollback()
    with engine.begin() as connection:
        kept = record_decision(connection, registry, "send_refund", REFUND, run_id="kept")

    report = await Dispatcher(settings).drain()
    messages = await read_all(amqp_server_url, settings.queue, expect=1)

    assert report.published == 1
    assert [m.body.operation_id for m in messages] == [kept.operation.id]


def test_the_claim_query_uses_the_partial_index(database_url: str, registry: Registry) -> None:
    record_many(database_url, registry, 3000)
    with psycopg.connect(database_url) as connection:
        # Most rows published, as in a healthy system: pending rows are few.
        connection.execute("UPDATE outbox SET published_at = now() WHERE id % 50 <> 0")
        connection.execute("ANALYZE outbox")
        connection.commit()
        with connection.transaction(force_rollback=True):
            plan = "\n".join(
                row[0]
                for row in connection.execute(
                    "EXPLAIN " + QUERIES["claim_outbox_batch"].sql, {"batch_size": 200}
                )
            )

    assert "outbox_pending" in plan, plan
    assert "Seq Scan on outbox" not in plan, plan


def test_a_draining_backlog_claim_skips_published_rows_and_probes_operations(
    database_url: str, registry: Registry
) -> None:
    """Mid-drain of a backlog: statistics from when every row was pending, most rows
    published since. The claim must neither filter its way past the published rows (a
    cost growing with every batch) nor read every operation to join a batch's rows."""
    record_many(database_url, registry, 2000)
    with psycopg.connect(database_url) as connection:
        # A backlog big enough for the planner to prefer the primary key: more outbox
        # rows per operation (as re-queued operations have), 20,000 in all.
        connection.execute(
            "INSERT INTO outbox (operation_id, routing_key) "
            "SELECT operation_id, routing_key FROM outbox, generate_series(1, 9)"
        )
        # Churn every row's index entries once (published, pending again), so that
        # outbox_pending holds more pages than the primary key, as after earlier drains;
        # the statistics are then taken while every row is pending.
        connection.execute("UPDATE outbox SET published_at = now()")
        connection.execute("UPDATE outbox SET published_at = NULL")
        connection.commit()
        connection.autocommit = True
        connection.execute("VACUUM ANALYZE outbox")
        connection.execute("ANALYZE operations")
        connection.autocommit = False
        connection.execute(
            "UPDATE outbox SET published_at = now() WHERE id < (SELECT max(id) - 150 FROM outbox)"
        )
        connection.commit()
        with connection.transaction(force_rollback=True):
            plan = "\n".join(
                row[0]
                for row in connection.execute(
                    "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + QUERIES["claim_outbox_batch"].sql,
                    {"batch_size": 100},
                )
            )

    removed = [
        int(line.rsplit(":", 1)[1])
        for line in plan.splitlines()
        if "Rows Removed by Filter" in line
    ]
    assert sum(removed) < 100, plan
    assert "Seq Scan on operations" not in plan, plan
    assert "rows=100 loops=1" in plan, plan  # the claim still finds a full batch


async def test_commit_order_gaps_lose_nothing_while_a_high_water_mark_poller_skips_rows(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    """Ids are assigned at insert, visible at commit: a later id can commit first.

    Eight writers hold transactions open for random times while the dispatcher runs.
    A naive ``id > last_seen`` poller watches the same table as a canary; one gap is
    forced (a low id held open until the canary has seen a higher one) so the test is
    proven able to see the bug, and the random ones add more.
    """
    writers, rows_each = 8, 40
    rng = random.Random(7)
    held_row_inserted = threading.Event()
    canary_passed_it = threading.Event()
    stop_canary = threading.Event()
    canary_seen: set[int] = set()
    failures: list[BaseException] = []

    def canary() -> None:
        last_seen = 0
        with psycopg.connect(database_url, autocommit=True) as connection:
            while True:
                finished = stop_canary.is_set()
                for (row_id,) in connection.execute(
                    "SELECT id FROM outbox WHERE id > %s ORDER BY id", (last_seen,)
                ):
                    canary_seen.add(row_id)
                    last_seen = row_id
                if held_row_inserted.is_set() and last_seen > held_id[0]:
                    canary_passed_it.set()
                if finished:
                    return

    held_id = [0]

    def held_writer() -> None:
        with psycopg.connect(database_url) as connection:
            record_decision(connection, registry, "send_refund", REFUND, run_id="held")
            held_id[0] = connection.execute("SELECT max(id) FROM outbox").fetchone()[0]  # type: ignore[index]
            held_row_inserted.set()
            if not canary_passed_it.wait(timeout=30):
                raise AssertionError("the canary never passed the held row")
            connection.commit()

    def writer(index: int) -> None:
        held_row_inserted.wait(timeout=30)
        with psycopg.connect(database_url) as connection:
            for n in range(rows_each):
                record_decision(
                    connection,
                    registry,
                    "send_refund",
                    {"payment_id": f"p{index}_{n}", "amount_cents": 1 + n},
                    run_id=f"writer_{index}",
                )
                hold = rng.choice([0.0, 0.0, 0.001, 0.005, 0.02])
                if hold:
                    threading.Event().wait(hold)  # the transaction stays open meanwhile
                connection.commit()

    def guarded(target: Any, *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            except BaseException as failure:  # re-raised in the test thread
                failures.append(failure)

        return threading.Thread(target=run)

    async with running_dispatcher(settings):
        canary_thread = guarded(canary)
        threads = [guarded(held_writer)] + [guarded(writer, i) for i in range(writers)]
        canary_thread.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            await asyncio.to_thread(thread.join, 60)
        stop_canary.set()
        await asyncio.to_thread(canary_thread.join, 30)
        total = 1 + writers * rows_each
        await eventually(
            lambda: all_published(database_url, total), within=30, what="every row published"
        )

    assert failures == []
    messages = await read_all(amqp_server_url, settings.queue, expect=total)
    all_ids = {row[0] for row in execute_admin(database_url, "SELECT id FROM outbox")}
    assert len(all_ids) == total
    assert {m.body.outbox_id for m in messages} == all_ids
    assert len(messages) == total
    skipped_by_canary = all_ids - canary_seen
    assert held_id[0] in skipped_by_canary
    assert skipped_by_canary, "the canary must demonstrate the high-water-mark bug"


async def test_an_unroutable_message_is_a_failure_until_the_binding_returns(
    settings: Settings,
    registry: Registry,
    engine: Any,
    database_url: str,
    amqp_server_url: str,
    broker_names: Topology,
) -> None:
    connection = await aio_pika.connect(amqp_server_url)
    async with connection, running_dispatcher(settings) as dispatcher:
        channel = await connection.channel()
        queue = await channel.get_queue(broker_names.queue)
        await queue.unbind(broker_names.exchange, routing_key="#")

        with engine.begin() as db:
            record_decision(db, registry, "send_refund", REFUND, run_id="r")

        async def failed_at_least_twice() -> bool:
            rows = await asyncio.to_thread(
                execute_admin,
                database_url,
                "SELECT publish_attempts, last_error, published_at FROM outbox",
            )
            return bool(rows[0][0] >= 2)

        await eventually(failed_at_least_twice, within=20, what="two failed publishes")
        ((_, last_error, published_at),) = execute_admin(
            database_url, "SELECT publish_attempts, last_error, published_at FROM outbox"
        )
        assert published_at is None
        assert last_error.startswith("unroutable")
        assert "NO_ROUTE" in last_error
        assert (
            counter_value(
                dispatcher, "outbox_dispatcher_publish_failures_total", reason="unroutable"
            )
            >= 2
        )

        await queue.bind(broker_names.exchange, routing_key="#")
        await eventually(
            lambda: all_published(database_url, 1), within=20, what="publish after rebinding"
        )

    messages = await read_all(amqp_server_url, settings.queue, expect=1)
    assert len(messages) == 1


async def test_a_row_committed_before_the_dispatcher_listened_is_published_at_start(
    settings: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    with engine.begin() as connection:  # its NOTIFY reaches nobody
        record_decision(connection, registry, "send_refund", REFUND, run_id="early")

    async with running_dispatcher(settings):
        await eventually(
            lambda: all_published(database_url, 1), within=10, what="the early row published"
        )


async def test_a_lost_notification_is_covered_by_the_poll(
    settings: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    async with running_dispatcher(settings):
        # No notification at all for this row: only the poll can find it.
        execute_admin(database_url, "ALTER TABLE outbox DISABLE TRIGGER outbox_notify_pending")
        with engine.begin() as connection:
            record_decision(connection, registry, "send_refund", REFUND, run_id="silent")
        await eventually(
            lambda: all_published(database_url, 1),
            within=10,
            what="the silent row published by the poll fallback",
        )


@pytest.mark.parametrize("dispatchers", [2, 4])
async def test_several_dispatchers_share_the_table_and_publish_every_row_once(
    settings: Settings,
    registry: Registry,
    database_url: str,
    amqp_server_url: str,
    dispatchers: int,
) -> None:
    shared = settings.model_copy(update={"batch_size": 25})
    rows = 1200
    async with dispatcher_group(shared, dispatchers) as running:
        await asyncio.to_thread(record_many, database_url, registry, rows, chunk=50)
        await eventually(
            lambda: all_published(database_url, rows), within=60, what="every row published"
        )

        def published_counted() -> list[float]:
            return [
                counter_value(d, "outbox_dispatcher_published_total", tool="send_refund")
                for d in running
            ]

        # A dispatcher counts its batch once the commit has returned, which is after
        # the database already shows the rows published: wait for the last count too.
        async def all_counted() -> bool:
            return sum(published_counted()) >= rows

        await eventually(all_counted, within=30, what="every row counted")
        per_dispatcher = published_counted()

    messages = await read_all(amqp_server_url, settings.queue, expect=rows)
    counts = Counter(m.body.outbox_id for m in messages)
    all_ids = {row[0] for row in execute_admin(database_url, "SELECT id FROM outbox")}
    assert set(counts) == all_ids
    assert max(counts.values()) == 1
    assert sum(per_dispatcher) == rows


@contextlib.asynccontextmanager
async def dispatcher_group(settings: Settings, count: int) -> AsyncIterator[list[Dispatcher]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running_dispatcher(settings)) for _ in range(count)]


async def test_a_killed_database_connection_is_replaced(
    settings: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    async with running_dispatcher(settings) as dispatcher:
        terminated = execute_admin(
            database_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = 'outbox-dispatcher'",
        )
        assert len(terminated) >= 2  # the batch connection and the LISTEN connection
        with engine.begin() as connection:
            record_decision(connection, registry, "send_refund", REFUND, run_id="after_kill")
        await eventually(
            lambda: all_published(database_url, 1), within=20, what="publish after the kill"
        )
        assert counter_value(dispatcher, "outbox_dispatcher_reconnects_total", peer="database") >= 1


async def test_retention_deletes_only_old_published_rows_in_batches(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 2500)
    execute_admin(
        database_url,
        "UPDATE outbox SET published_at = now() - interval '8 days' WHERE id % 5 <> 0",
    )
    execute_admin(
        database_url, "UPDATE outbox SET published_at = now() - interval '1 day' WHERE id % 5 = 1"
    )
    dispatcher = Dispatcher(settings)

    deleted = await dispatcher.prune()

    assert deleted == 1500  # 2000 old rows minus the 500 re-stamped to one day ago
    remaining = execute_admin(
        database_url,
        "SELECT count(*) FILTER (WHERE published_at IS NULL), count(published_at) FROM outbox",
    )
    assert remaining == [(500, 500)]
    assert counter_value(dispatcher, "outbox_dispatcher_retention_deleted_rows_total") == 1500


async def test_metrics_and_health_are_served_over_http(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 30)
    async with running_dispatcher(settings) as dispatcher:
        await eventually(
            lambda: all_published(database_url, 30), within=10, what="every row published"
        )
        async with await psycopg.AsyncConnection.connect(database_url) as connection:
            await dispatcher.refresh_backlog(connection)
        base = f"http://127.0.0.1:{dispatcher.metrics_port}"
        health = await asyncio.to_thread(fetch, f"{base}/healthz")
        exposition = await asyncio.to_thread(fetch, f"{base}/metrics")

    assert health == (200, "ok\n")
    families = {f.name: f for f in text_string_to_metric_families(exposition[1])}
    published = [
        s for s in families["outbox_dispatcher_published"].samples if s.name.endswith("_total")
    ]
    assert [(s.labels, s.value) for s in published] == [({"tool": "send_refund"}, 30.0)]
    assert families["outbox_dispatcher_backlog_rows"].samples[0].value == 0.0
    assert families["outbox_dispatcher_oldest_pending_age_seconds"].samples[0].value == 0.0
    latency_count = [
        s
        for s in families["outbox_dispatcher_commit_to_confirm_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert latency_count[0].value == 30.0
    # Never an id among our labels (the platform collector's python_info has its own).
    for family in families.values():
        for sample in family.samples:
            if sample.name.startswith("outbox_"):
                allowed = {
                    "tool",
                    "state",
                    "reason",
                    "peer",
                    "le",
                    "queue",
                    "version",
                    "verdict",
                    "limit",
                }
                assert set(sample.labels) <= allowed, sample.name


def fetch(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


async def test_backlog_metrics_count_pending_rows(
    settings: Settings, registry: Registry, database_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 12)
    dispatcher = Dispatcher(settings)
    async with await psycopg.AsyncConnection.connect(database_url) as connection:
        backlog = await dispatcher.refresh_backlog(connection)

    assert backlog.pending == 12
    assert backlog.oldest_age_seconds > 0
    assert counter_value(dispatcher, "outbox_dispatcher_backlog_rows") == 12
