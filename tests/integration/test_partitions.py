"""A database link that goes silent mid-transaction costs seconds, never an operation.

A TCP proxy between one daemon and Postgres silences exactly one connection at the
worst moment: the consumer's right after the UPDATE that claims a delivery (the row
stays locked, the COMMIT never comes), or right after the statement that records a
confirmed refund (it commits on its own; the answer never comes back), the dispatcher's
right after its claim (the outbox row stays locked, other claims skip it). The client
cuts the link at its transaction deadline; the server ends a stalled session at its
idle_in_transaction_session_timeout; the operation settles, with one effect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from pydantic import SecretStr

from consumer.worker import Consumer
from harness.proxy import TcpProxy, url_through
from outbox import Operation, OperationState, Registry, Settings, record_decision
from outbox.connections import DatabaseBounds

from support.broker_helpers import read_all
from support.consume_helpers import event_names, in_state, operation, running_consumer
from support.dispatch_helpers import all_published, counter_value, running_dispatcher
from support.sample_tools import Ledger
from support.waiting import eventually

S = OperationState
# The consumer's record of a confirmed effect (commit_operations in queries.sql), its
# claim (claim_deliveries) and the dispatcher's claim (claim_outbox_batch): sent as text
# the first time each runs.
RECORDING_A_CONFIRMED_EFFECT = b"SET state = 'committed'"
CLAIMING_DELIVERIES = b"AS d (id, lease, tool_name, tool_version, input_fingerprint)"
CLAIMING_OUTBOX_ROWS = b"SELECT id, operation_id, routing_key, headers"


def bounded(settings: Settings, proxy: TcpProxy, **changes: Any) -> Settings:
    """The daemon under test reaches the database through the proxy, with the bounds
    derived from its lease margin (the defaults a user gets)."""
    return settings.model_copy(
        update={
            "database_url": SecretStr(
                url_through(settings.database_url.get_secret_value(), proxy.port)
            ),
            "db_transaction_timeout": None,
            "reconcile_interval": 0.05,
            **changes,
        }
    )


def decide_refund(engine: Any, registry: Registry) -> Operation:
    with engine.begin() as connection:
        return record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 900},
            run_id="partition",
        ).operation


@contextlib.asynccontextmanager
async def settled_through_silence(
    settings: Settings,
    consumer_settings: Settings,
    registry: Registry,
    database_proxy: TcpProxy,
    op: Operation,
    *,
    what: str,
) -> AsyncIterator[Consumer]:
    """The dispatcher and a consumer behind the proxy, once the consumer's link went
    silent and the refund settled anyway; yields the consumer for its counters."""
    async with (
        running_dispatcher(settings),
        running_consumer(consumer_settings, registry) as consumer,
    ):
        await asyncio.wait_for(database_proxy.went_silent.wait(), timeout=30)
        database_url = settings.database_url.get_secret_value()
        await eventually(in_state(database_url, op.id, S.COMMITTED), within=60, what=what)
        yield consumer


def assert_one_refund(database_url: str, ledger: Ledger, op: Operation) -> None:
    """One call, and one attempt that committed (suppressed duplicates aside)."""
    assert ledger.calls == [str(op.id)]
    transitions = [
        name for name in event_names(database_url, op.id) if name != "operation.delivery_suppressed"
    ]
    assert transitions == ["operation.prepared", "operation.attempted", "operation.committed"]


def stalled_sessions(database_url: str, application: str, statement: bytes) -> list[int]:
    """Backends of ``application`` in this database still inside a transaction whose
    last statement contains ``statement``."""
    with psycopg.connect(database_url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = %s AND xact_start IS NOT NULL AND position(%s in query) > 0",
            (application, statement.decode()),
        ).fetchall()
    return [pid for (pid,) in rows]


def sessions_ended_by_the_server(database_url: str) -> int:
    """Sessions of this database that a FATAL error ended (a timeout among them)."""
    with psycopg.connect(database_url, autocommit=True) as connection:
        row = connection.execute(
            "SELECT sessions_fatal FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


async def test_a_consumer_claim_whose_link_goes_silent_is_cut_and_the_refund_settles_once(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    database_proxy: TcpProxy,
) -> None:
    consumer_settings = bounded(settings, database_proxy, lease_margin=2.0)
    bounds = DatabaseBounds.from_settings(consumer_settings)
    assert (bounds.transaction, bounds.hard_transaction, bounds.idle_in_transaction) == (
        0.5,
        1.0,
        1.0,
    )
    fatal_before = await asyncio.to_thread(sessions_ended_by_the_server, database_url)
    database_proxy.go_silent_on(CLAIMING_DELIVERIES)
    op = decide_refund(engine, registry)

    # The claim's UPDATE runs and the row stays locked by a session the consumer can no
    # longer reach, its COMMIT never sent; the refund must still settle, once.
    async with settled_through_silence(
        settings,
        consumer_settings,
        registry,
        database_proxy,
        op,
        what="the refund to settle although its claiming session went silent",
    ) as consumer:

        async def stalled_session_gone() -> bool:
            return not await asyncio.to_thread(
                stalled_sessions, database_url, "outbox-consumer", CLAIMING_DELIVERIES
            )

        await eventually(
            stalled_session_gone,
            within=bounds.idle_in_transaction + 10,
            what="the server to end the session stalled in its transaction",
        )
        # Cut at the soft deadline as silent, and the delivery kept in hand meanwhile
        # (retried, never sent back to the queue).
        assert (
            counter_value(consumer, "outbox_database_slow_transactions_total", verdict="silent")
            >= 1
        )
        assert counter_value(consumer, "outbox_consumer_deliveries_held_total") >= 1
        assert (
            counter_value(consumer, "outbox_consumer_deliveries_total", result="retry_later") == 0
        )

    async def ended_by_timeout() -> bool:
        return await asyncio.to_thread(sessions_ended_by_the_server, database_url) > fatal_before

    await eventually(ended_by_timeout, within=10, what="a session ended by a server timeout")
    # The stalled claim was rolled back with its session: the call came after the claim
    # that committed, once.
    assert_one_refund(database_url, ledger, op)


async def test_a_record_whose_answer_is_lost_is_cut_and_the_refund_settles_once(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    database_proxy: TcpProxy,
) -> None:
    """The record of a confirmed effect is one statement in autocommit: the server
    commits it, and the link goes silent before the answer comes back."""
    consumer_settings = bounded(settings, database_proxy, lease_margin=2.0)
    database_proxy.go_silent_on(RECORDING_A_CONFIRMED_EFFECT)
    op = decide_refund(engine, registry)

    async with settled_through_silence(
        settings,
        consumer_settings,
        registry,
        database_proxy,
        op,
        what="the refund's record to land although its answer was lost",
    ) as consumer:

        async def cut_as_silent() -> bool:
            silent = "outbox_database_slow_transactions_total"
            return counter_value(consumer, silent, verdict="silent") >= 1

        await eventually(cut_as_silent, within=30, what="the record cut at its deadline")

        async def held_and_retried() -> bool:
            return counter_value(consumer, "outbox_consumer_deliveries_held_total") >= 1

        # The delivery is kept in hand and its record tried again: it finds the refund
        # recorded, so nothing is sent back to the queue and nothing is called twice.
        await eventually(held_and_retried, within=30, what="the record tried again in hand")
        assert (
            counter_value(consumer, "outbox_consumer_deliveries_total", result="retry_later") == 0
        )

    assert_one_refund(database_url, ledger, op)
    final = operation(database_url, op.id)
    assert final.provider_reference == f"re_{str(op.id)[:8]}"


async def test_a_claim_whose_link_goes_silent_is_cut_and_its_rows_are_published(
    settings: Settings,
    registry: Registry,
    engine: Any,
    database_url: str,
    amqp_server_url: str,
    database_proxy: TcpProxy,
) -> None:
    dispatcher_settings = bounded(settings, database_proxy, lease_margin=2.0, publish_timeout=1.0)
    bounds = DatabaseBounds.from_settings(
        dispatcher_settings, held_open_for=dispatcher_settings.publish_timeout
    )
    assert (bounds.transaction, bounds.hard_transaction, bounds.idle_in_transaction) == (
        1.5,
        2.0,
        2.0,
    )
    database_proxy.go_silent_on(CLAIMING_OUTBOX_ROWS)
    with engine.begin() as connection:
        for n in range(3):
            record_decision(
                connection,
                registry,
                "send_refund",
                {"payment_id": f"pay_{n}", "amount_cents": 100 + n},
                run_id="partition",
            )

    async with running_dispatcher(dispatcher_settings) as dispatcher:
        await asyncio.wait_for(database_proxy.went_silent.wait(), timeout=30)
        await eventually(
            lambda: all_published(database_url, 3),
            within=60,
            what="the rows a silent session had claimed to be published",
        )

        async def stalled_session_gone() -> bool:
            return not await asyncio.to_thread(
                stalled_sessions, database_url, "outbox-dispatcher", CLAIMING_OUTBOX_ROWS
            )

        await eventually(
            stalled_session_gone,
            within=bounds.idle_in_transaction + 10,
            what="the server to end the dispatcher session stalled in its claim",
        )
        assert counter_value(dispatcher, "outbox_dispatcher_reconnects_total", peer="database") >= 1

    messages = await read_all(amqp_server_url, settings.queue, expect=3)
    assert len({message.body.operation_id for message in messages}) == 3


async def test_a_silent_broker_link_is_noticed_by_the_consumer_within_its_heartbeats(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    broker_proxy: TcpProxy,
) -> None:
    heartbeat = 1
    consumer_settings = settings.model_copy(
        update={
            "amqp_url": SecretStr(
                url_through(settings.amqp_url.get_secret_value(), broker_proxy.port)
            ),
            "amqp_heartbeat": heartbeat,
        }
    )

    def decide(payment_id: str) -> Any:
        with engine.begin() as connection:
            return record_decision(
                connection,
                registry,
                "send_refund",
                {"payment_id": payment_id, "amount_cents": 500},
                run_id="silence",
            ).operation

    async with (
        running_dispatcher(settings),
        running_consumer(consumer_settings, registry) as consumer,
    ):
        broker_proxy.blackhole()

        async def noticed() -> bool:
            return (
                counter_value(consumer, "outbox_consumer_reconnects_total") >= 1
                and not consumer.healthy()
            )

        # aiormq gives up on a peer after missing a few heartbeats; the bound is a
        # handful of heartbeat intervals, with room for a busy machine.
        await eventually(
            noticed, within=heartbeat * 10 + 10, what="the consumer to notice the silence"
        )
        op = decide("pay_after_silence")
        broker_proxy.restore()
        await eventually(
            in_state(database_url, op.id, S.COMMITTED),
            within=60,
            what="the consumer to reconnect and settle a new decision",
        )
    assert ledger.calls == [str(op.id)]
