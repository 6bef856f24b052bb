"""Several broker addresses against the real broker: an address that refuses is passed
over, one whose connection broke is tried last next time, and both daemons run on a
list whose first address is dead. (The three-node cluster is test_broker_cluster.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlsplit
from uuid import UUID

import psycopg
import pytest
from pydantic import SecretStr

import outbox.broker
from harness.proxy import tcp_proxy_for, url_through
from outbox import (
    EffectResult,
    ExecutionContext,
    OperationState,
    Registry,
    Settings,
    record_decision,
)
from outbox.broker import connect

from support.consume_helpers import event_names, in_state, operation, running_consumer
from support.dispatch_helpers import all_published, record_many, running_dispatcher
from support.logs import logged, rendered
from support.ports import closed_port
from support.sample_tools import Ledger, RefundInput, refund_contract
from support.waiting import eventually


@pytest.fixture(autouse=True)
def fresh_failure_memory() -> Iterator[None]:
    outbox.broker.forget_failed_addresses()
    yield
    outbox.broker.forget_failed_addresses()


def host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 5672}"


def dead_address(amqp_server_url: str) -> str:
    return url_through(amqp_server_url, closed_port())


async def test_a_refusing_first_address_is_passed_over(
    amqp_server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead = dead_address(amqp_server_url)
    caplog.set_level("INFO", logger="outbox.broker")

    connection = await connect([dead, amqp_server_url], connection_name="failover test")
    async with connection:
        channel = await connection.channel()
        assert not channel.is_closed

    # aiormq reports a refusal as its own AMQPConnectionError (errno 111 first).
    assert logged(
        caplog, "broker.address_failed", broker=host_port(dead), error="AMQPConnectionError"
    )
    assert logged(caplog, "broker.connected", broker=host_port(amqp_server_url))
    # The fields name a host and a port, never a URL with its password.
    assert "guest:guest" not in rendered(caplog)


async def test_a_connection_the_network_broke_sends_the_next_connect_elsewhere(
    amqp_server_url: str,
) -> None:
    async with tcp_proxy_for(amqp_server_url, 5672) as proxy:
        through_proxy = url_through(amqp_server_url, proxy.port)
        urls = [through_proxy, amqp_server_url]
        connection = await connect(urls)
        assert proxy.connections_accepted == 1
        lost = asyncio.Event()
        connection.close_callbacks.add(lambda *_: lost.set())

        proxy.cut()
        await asyncio.wait_for(lost.wait(), timeout=10)
        again = await connect(urls)
        await again.close()

        # Straight to the second address: the one that broke was not tried first.
        assert proxy.connections_accepted == 1


async def test_both_daemons_run_on_a_list_whose_first_address_is_dead(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    database_url: str,
    amqp_server_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="outbox.broker")
    listed = settings.model_copy(
        update={"amqp_url": SecretStr(f"{dead_address(amqp_server_url)}, {amqp_server_url}")}
    )
    await asyncio.to_thread(record_many, database_url, registry, 20)

    async with running_dispatcher(listed), running_consumer(listed, registry):
        await eventually(
            lambda: all_published(database_url, 20), within=20, what="every row published"
        )

        async def all_refunded() -> bool:
            return len(ledger.refunds) == 20

        await eventually(all_refunded, within=20, what="every refund made")

    assert sorted(ledger.calls) == sorted(ledger.refunds)  # one call each
    connected = {
        getattr(record, "broker", None)
        for record in caplog.records
        if getattr(record, "action", None) == "broker.connected"
    }
    assert connected == {host_port(amqp_server_url)}


async def test_an_effect_in_hand_outlives_the_broker_connection_that_delivered_it(
    settings: Settings,
    ledger: Ledger,
    database_url: str,
    amqp_server_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The refund is in the tool's hands when the consumer's broker link breaks. It must
    # finish and be recorded by that same attempt, not sit in flight until its lease
    # runs out and then be looked up and called a second time.
    started, release = asyncio.Event(), asyncio.Event()

    async def slow_refund(refund: RefundInput, ctx: ExecutionContext) -> EffectResult:
        started.set()
        await release.wait()
        return await ledger.refund(refund, ctx)

    registry = Registry()
    registry.register(
        dataclasses.replace(
            refund_contract(ledger), execute=slow_refund, deadline=timedelta(seconds=30)
        )
    )
    operation_id = await asyncio.to_thread(record_one, database_url, registry)
    async with tcp_proxy_for(amqp_server_url, 5672) as proxy:
        proxied = settings.model_copy(
            update={"amqp_url": SecretStr(url_through(amqp_server_url, proxy.port))}
        )
        async with running_dispatcher(settings), running_consumer(proxied, registry):
            await asyncio.wait_for(started.wait(), timeout=20)
            proxy.cut()
            await eventually(
                lambda: _now(logged(caplog, "consumer.session_lost", peer="broker")),
                within=20,
                what="the consumer to notice its link is gone",
            )
            release.set()
            await eventually(
                in_state(database_url, operation_id, OperationState.COMMITTED),
                within=20,
                what="the refund to be recorded",
            )

    stored = operation(database_url, operation_id)
    assert stored.attempts == 1
    assert ledger.calls == [str(operation_id)]
    names = event_names(database_url, operation_id)
    assert "operation.outcome_unknown" not in names
    assert names.count("operation.attempted") == 1


async def _now(value: bool) -> bool:
    return value


def record_one(database_url: str, registry: Registry) -> UUID:
    with psycopg.connect(database_url) as connection, connection.transaction():
        recorded = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_in_hand", "amount_cents": 100},
            run_id="run",
        )
    return recorded.operation.id
