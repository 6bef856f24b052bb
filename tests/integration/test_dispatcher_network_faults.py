"""A silent or severed network between the dispatcher and the broker (TCP proxy)."""

from __future__ import annotations

import asyncio

from pydantic import SecretStr

from harness.proxy import TcpProxy, url_through
from outbox import Registry, Settings

from support.broker_helpers import read_all
from support.dispatch_helpers import (
    all_published,
    counter_value,
    publish_state,
    record_many,
    running_dispatcher,
)
from support.waiting import eventually


def through(settings: Settings, proxy: TcpProxy) -> Settings:
    return settings.model_copy(
        update={
            "amqp_url": SecretStr(url_through(settings.amqp_url.get_secret_value(), proxy.port)),
            "amqp_heartbeat": 1,
            "publish_timeout": 2.0,
        }
    )


async def test_a_silent_broker_is_detected_and_nothing_is_lost(
    settings: Settings,
    registry: Registry,
    database_url: str,
    amqp_server_url: str,
    broker_proxy: TcpProxy,
) -> None:
    async with running_dispatcher(through(settings, broker_proxy)) as dispatcher:
        await asyncio.to_thread(record_many, database_url, registry, 50)
        await eventually(
            lambda: all_published(database_url, 50), within=20, what="rows before the silence"
        )

        broker_proxy.blackhole()
        await asyncio.to_thread(record_many, database_url, registry, 50, run_id="silence")

        async def noticed() -> bool:
            return (
                counter_value(dispatcher, "outbox_dispatcher_reconnects_total", peer="broker") >= 1
            )

        await eventually(noticed, within=30, what="the dispatcher to notice the silent broker")
        assert (await asyncio.to_thread(publish_state, database_url))[1] < 100
        assert not dispatcher.healthy()

        broker_proxy.restore()
        await eventually(
            lambda: all_published(database_url, 100), within=60, what="every row published"
        )

    messages = await read_all(amqp_server_url, settings.queue, expect=100)
    assert len({m.body.outbox_id for m in messages}) == 100


async def test_a_cut_connection_is_reopened(
    settings: Settings,
    registry: Registry,
    database_url: str,
    amqp_server_url: str,
    broker_proxy: TcpProxy,
) -> None:
    async with running_dispatcher(through(settings, broker_proxy)) as dispatcher:
        accepted_before = broker_proxy.connections_accepted
        broker_proxy.cut()
        await asyncio.to_thread(record_many, database_url, registry, 80)
        await eventually(
            lambda: all_published(database_url, 80), within=30, what="every row published"
        )
        assert broker_proxy.connections_accepted > accepted_before
        assert counter_value(dispatcher, "outbox_dispatcher_reconnects_total", peer="broker") >= 1

    messages = await read_all(amqp_server_url, settings.queue, expect=80)
    assert len({m.body.outbox_id for m in messages}) == 80
