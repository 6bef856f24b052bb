"""The broker goes away under a running dispatcher; nothing committed is lost."""

from __future__ import annotations

import asyncio
import subprocess
from collections import Counter

import pytest

from dispatcher.daemon import Dispatcher
from outbox import Registry, Settings

from support.broker_helpers import read_all
from support.dispatch_helpers import all_published, counter_value, record_many, running_dispatcher
from support.waiting import eventually

pytestmark = pytest.mark.rabbitmqctl


def rabbitmqctl(*args: str) -> str:
    result = subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def close_connections_of(dispatcher: Dispatcher) -> int:
    """Close this dispatcher's broker connections (found by their connection name)."""
    listing = rabbitmqctl(
        "list_connections", "-q", "--no-table-headers", "pid", "client_properties"
    )
    closed = 0
    for line in listing.splitlines():
        pid, _, properties = line.partition("\t")
        if dispatcher.worker_id in properties:
            rabbitmqctl("close_connection", pid.strip(), "test: broker closed the connection")
            closed += 1
    return closed


def reconnects(dispatcher: Dispatcher) -> float:
    return counter_value(dispatcher, "outbox_dispatcher_reconnects_total", peer="broker")


async def test_closed_broker_connections_are_reopened_and_everything_is_published(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    async with running_dispatcher(settings) as dispatcher:
        await asyncio.to_thread(record_many, database_url, registry, 200)
        assert await asyncio.to_thread(close_connections_of, dispatcher) == 1
        await asyncio.to_thread(record_many, database_url, registry, 200, run_id="after")
        await eventually(
            lambda: all_published(database_url, 400), within=30, what="every row published"
        )
        assert reconnects(dispatcher) >= 1

    messages = await read_all(amqp_server_url, settings.queue, expect=400)
    counts = Counter(m.body.outbox_id for m in messages)
    assert len(counts) == 400


@pytest.mark.timeout(180)
async def test_a_broker_stopped_and_started_again_loses_nothing(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    async with running_dispatcher(settings) as dispatcher:
        await asyncio.to_thread(record_many, database_url, registry, 100)
        await eventually(
            lambda: all_published(database_url, 100), within=20, what="the first rows published"
        )
        await asyncio.to_thread(rabbitmqctl, "stop_app")
        try:
            # Decisions keep arriving while the broker is down: they wait in the outbox.
            await asyncio.to_thread(record_many, database_url, registry, 150, run_id="outage")
            assert not await all_published(database_url, 250)
        finally:
            await asyncio.to_thread(rabbitmqctl, "start_app")
            await asyncio.to_thread(rabbitmqctl, "await_startup")
        await eventually(
            lambda: all_published(database_url, 250), within=60, what="every row published"
        )
        assert reconnects(dispatcher) >= 1

    messages = await read_all(amqp_server_url, settings.queue, expect=250)
    assert {m.body.outbox_id for m in messages} == set(range(1, 251))
