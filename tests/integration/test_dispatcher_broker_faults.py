"""The broker goes away under a running dispatcher; nothing committed is lost.

The broker is a node of the test's own (:mod:`harness.rabbit_node`): stopping the
machine's shared RabbitMQ would break whatever else uses it meanwhile (another test run,
another project's CI)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from dispatcher.daemon import Dispatcher
from harness.rabbit_node import Node, RabbitCluster, private_broker
from outbox import Registry, Settings

from support.broker_helpers import read_all
from support.dispatch_helpers import all_published, counter_value, record_many, running_dispatcher
from support.waiting import eventually

pytestmark = pytest.mark.rabbit_cluster  # rabbitmq-server, for a node of our own

PrivateBroker = tuple[RabbitCluster, Node]


@pytest.fixture(scope="module")
def broker() -> Iterator[PrivateBroker]:
    # One node for the module: each test's broker names are its own.
    with private_broker(prefix="outbox_faults") as started:
        yield started


@pytest.fixture
def broker_settings(settings: Settings, broker: PrivateBroker) -> Settings:
    return settings.model_copy(update={"amqp_url": SecretStr(broker[1].url)})


def rabbitmqctl(broker: PrivateBroker, *args: str) -> str:
    cluster, node = broker
    return cluster.ctl(node, *args)


def close_connections_of(broker: PrivateBroker, dispatcher: Dispatcher) -> int:
    """Close this dispatcher's broker connections (found by their connection name)."""
    listing = rabbitmqctl(
        broker, "list_connections", "-q", "--no-table-headers", "pid", "client_properties"
    )
    closed = 0
    for line in listing.splitlines():
        pid, _, properties = line.partition("\t")
        if dispatcher.worker_id in properties:
            rabbitmqctl(broker, "close_connection", pid.strip(), "test: broker closed it")
            closed += 1
    return closed


def reconnects(dispatcher: Dispatcher) -> float:
    return counter_value(dispatcher, "outbox_dispatcher_reconnects_total", peer="broker")


async def test_closed_broker_connections_are_reopened_and_everything_is_published(
    broker_settings: Settings, registry: Registry, database_url: str, broker: PrivateBroker
) -> None:
    settings = broker_settings
    async with running_dispatcher(settings) as dispatcher:
        await asyncio.to_thread(record_many, database_url, registry, 200)
        assert await asyncio.to_thread(close_connections_of, broker, dispatcher) == 1
        await asyncio.to_thread(record_many, database_url, registry, 200, run_id="after")
        await eventually(
            lambda: all_published(database_url, 400), within=30, what="every row published"
        )
        assert reconnects(dispatcher) >= 1

    messages = await read_all(broker[1].url, settings.queue, expect=400)
    counts = Counter(m.body.outbox_id for m in messages)
    assert len(counts) == 400


@pytest.mark.timeout(180)
async def test_a_broker_stopped_and_started_again_loses_nothing(
    broker_settings: Settings, registry: Registry, database_url: str, broker: PrivateBroker
) -> None:
    settings = broker_settings
    async with running_dispatcher(settings) as dispatcher:
        await asyncio.to_thread(record_many, database_url, registry, 100)
        await eventually(
            lambda: all_published(database_url, 100), within=20, what="the first rows published"
        )
        await asyncio.to_thread(rabbitmqctl, broker, "stop_app")
        try:
            # Decisions keep arriving while the broker is down: they wait in the outbox.
            await asyncio.to_thread(record_many, database_url, registry, 150, run_id="outage")
            assert not await all_published(database_url, 250)
        finally:
            await asyncio.to_thread(rabbitmqctl, broker, "start_app")
            await asyncio.to_thread(rabbitmqctl, broker, "await_startup")
        await eventually(
            lambda: all_published(database_url, 250), within=60, what="every row published"
        )
        assert reconnects(dispatcher) >= 1

    messages = await read_all(broker[1].url, settings.queue, expect=250)
    assert {m.body.outbox_id for m in messages} == set(range(1, 251))
