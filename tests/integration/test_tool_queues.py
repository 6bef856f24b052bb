"""A queue per group of tools (``OUTBOX_TOOL_QUEUES``) on the local broker: what
``outbox migrate --broker`` declares and binds, that every message reaches exactly one
queue (its group's, or the default one), that routes follow the setting when it
changes, and that a dead letter requeued goes back to its tool's queue.

Each test uses broker names of its own (the ``broker_names`` prefix) and deletes what
it declared.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

import aio_pika
import aiormq.exceptions
import pytest
from pydantic import SecretStr

from outbox.broker import Topology, declare_topology, delete_topology, require_topology
from outbox.cli import run_command
from outbox.errors import ConfigurationError, TopologyMissing
from outbox.migrate import declare_broker_topology
from outbox.settings import Settings

from support.broker_helpers import message_count, read_raw
from support.waiting import eventually

Grouped = Callable[[str], Settings]


@pytest.fixture
async def grouped(amqp_server_url: str, broker_names: Topology) -> AsyncIterator[Grouped]:
    """Settings on this test's names with the groups given (queue names are written
    relative to the test's prefix: ``{p}.pay``); every queue any of them named is deleted
    at the end."""
    prefix = broker_names.queue.removesuffix(".operations")
    named: set[str] = set()

    def make(groups: str) -> Settings:
        settings = Settings(
            amqp_url=SecretStr(amqp_server_url),
            exchange=broker_names.exchange,
            queue=broker_names.queue,
            dead_letter_exchange=broker_names.dead_letter_exchange,
            dead_letter_queue=broker_names.dead_letter_queue,
            tool_queues=groups.replace("{p}", prefix),
        )
        named.update(settings.tool_queue_groups)
        return settings

    yield make
    # broker_names deletes the rest (exchanges included) afterwards.
    everything = dataclasses.replace(
        broker_names, tool_queues=tuple((name, ()) for name in sorted(named))
    )
    await delete_topology(amqp_server_url, everything)


async def publish(settings: Settings, *keys: str) -> None:
    """One message per routing key, mandatory and confirmed: a key no queue takes fails
    here instead of vanishing."""
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(settings.exchange)
        for key in keys:
            await exchange.publish(
                aio_pika.Message(key.encode(), message_id=key), routing_key=key, mandatory=True
            )


async def keys_in(settings: Settings, queue: str) -> list[str]:
    """The routing keys of the messages in ``queue``, taken (so a later count starts
    empty), in arrival order."""
    count = await message_count(settings.amqp_url.get_secret_value(), queue)
    if not count:
        return []
    taken = await read_raw(settings.amqp_url.get_secret_value(), queue, expect=count)
    return [message.routing_key or "" for message in taken]


async def test_migrate_routes_each_group_to_its_queue_and_every_message_to_one_queue(
    grouped: Grouped,
) -> None:
    settings = grouped("{p}.pay=send_refund,charge_card;{p}.mail=send_email")
    pay, mail = settings.tool_queue_groups
    # Twice: a second run changes nothing (and refuses nothing).
    await declare_broker_topology(settings)
    await declare_broker_topology(settings)

    await publish(
        settings,
        "send_refund.v1",
        "send_refund.v2",  # a new version follows its tool
        "charge_card.v1",
        "send_email.v3",
        "lookup.v1",  # no group: the default queue
        "send_refund.extra.v1",  # another tool whose name starts with a grouped one's
    )

    # Polled: a quorum queue's count lags its confirm by a moment.
    async def all_counted() -> bool:
        counts = [
            await message_count(settings.amqp_url.get_secret_value(), queue)
            for queue in (pay, mail, settings.queue)
        ]
        return sum(counts) >= 6

    await eventually(all_counted, within=15, what="six messages in the three queues")
    assert sorted(await keys_in(settings, pay)) == [
        "charge_card.v1",
        "send_refund.v1",
        "send_refund.v2",
    ]
    assert await keys_in(settings, mail) == ["send_email.v3"]
    assert sorted(await keys_in(settings, settings.queue)) == [
        "lookup.v1",
        "send_refund.extra.v1",
    ]


async def test_the_group_queues_are_quorum_queues_with_the_default_queues_arguments(
    grouped: Grouped,
) -> None:
    settings = grouped("{p}.pay=send_refund")
    await declare_broker_topology(settings)
    [pay] = settings.tool_queue_groups
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        # Equivalent arguments redeclare quietly; any other argument would be refused
        # (PRECONDITION_FAILED), so this shows what the queue was declared with.
        await channel.declare_queue(
            pay, durable=True, arguments=Topology.from_settings(settings).queue_arguments
        )
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await channel.declare_queue(pay, durable=True, arguments={"x-queue-type": "classic"})


async def test_routes_follow_the_setting_when_a_tool_moves_and_when_groups_are_given_up(
    grouped: Grouped,
) -> None:
    first = grouped("{p}.a=send_refund,send_email")
    [queue_a] = first.tool_queue_groups
    await declare_broker_topology(first)

    # send_refund moves to a new queue and queue a leaves the setting altogether: a
    # route kept from before would now put send_refund in both queues.
    moved = grouped("{p}.b=send_refund")
    [queue_b] = moved.tool_queue_groups
    await declare_broker_topology(moved)
    await publish(moved, "send_refund.v1", "send_email.v1")

    async def arrived() -> bool:
        url = moved.amqp_url.get_secret_value()
        return await message_count(url, queue_b) + await message_count(url, moved.queue) >= 2

    await eventually(arrived, within=15, what="both messages routed")
    assert await keys_in(moved, queue_b) == ["send_refund.v1"]
    assert await keys_in(moved, moved.queue) == ["send_email.v1"]
    assert await keys_in(moved, queue_a) == []

    # No group: exactly the one exchange and queue of a deployment that never had any.
    none = grouped("")
    await declare_broker_topology(none)
    await publish(none, "send_refund.v1")
    await eventually(
        lambda: _holds(none, none.queue, 1), within=15, what="the default queue takes it"
    )
    assert await keys_in(none, none.queue) == ["send_refund.v1"]
    assert await keys_in(none, queue_b) == []
    topology = Topology.from_settings(moved)
    connection = await aio_pika.connect(none.amqp_url.get_secret_value())
    async with connection:
        for gone in (topology.by_tool_exchange, topology.other_tools_exchange):
            with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
                await (await connection.channel()).get_exchange(gone, ensure=True)


async def _holds(settings: Settings, queue: str, count: int) -> bool:
    return await message_count(settings.amqp_url.get_secret_value(), queue) >= count


async def test_a_daemon_with_groups_refuses_a_broker_migrated_without_them(
    grouped: Grouped,
) -> None:
    await declare_broker_topology(grouped(""))
    settings = grouped("{p}.pay=send_refund")
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        with pytest.raises(TopologyMissing, match="OUTBOX_TOOL_QUEUES"):
            await require_topology(await connection.channel(), Topology.from_settings(settings))


async def test_a_daemon_without_groups_refuses_to_declare_on_a_broker_routing_by_tool(
    grouped: Grouped,
) -> None:
    grouped_settings = grouped("{p}.pay=send_refund")
    (pay,) = grouped_settings.tool_queue_groups
    await declare_broker_topology(grouped_settings)
    ungrouped = Topology.from_settings(grouped(""))
    connection = await aio_pika.connect(grouped_settings.amqp_url.get_secret_value())
    async with connection:
        channel = await connection.channel()
        closed: list[object] = []
        channel.close_callbacks.add(lambda *_: closed.append(True))
        with pytest.raises(ConfigurationError, match=r"routes by tool .*OUTBOX_TOOL_QUEUES"):
            await declare_topology(channel, ungrouped)
        # The probe left the channel usable, and the routes as migrate made them: a
        # grouped tool's message reaches its group's queue and not the default one.
        assert (await require_topology(channel, ungrouped)).queue.name == grouped_settings.queue
        assert closed == []
    await publish(grouped_settings, "send_refund.v1", "lookup.v1")

    async def both_counted() -> bool:
        url = grouped_settings.amqp_url.get_secret_value()
        return await message_count(url, pay) + await message_count(url, grouped_settings.queue) >= 2

    await eventually(both_counted, within=15, what="two messages in the two queues")
    assert await keys_in(grouped_settings, pay) == ["send_refund.v1"]
    assert await keys_in(grouped_settings, grouped_settings.queue) == ["lookup.v1"]


async def test_a_consumer_of_a_group_is_given_that_groups_queue(grouped: Grouped) -> None:
    settings = grouped("{p}.pay=send_refund;{p}.mail=send_email")
    await declare_broker_topology(settings)
    _, mail = settings.tool_queue_groups
    consumer = settings.model_copy(update={"consume_queue": mail})
    connection = await aio_pika.connect(settings.amqp_url.get_secret_value())
    async with connection:
        declared = await require_topology(
            await connection.channel(), Topology.from_settings(consumer)
        )
    assert declared.queue.name == mail


async def test_a_requeued_dead_letter_goes_back_to_its_tools_queue(
    grouped: Grouped, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = grouped("{p}.pay=send_refund")
    [pay] = settings.tool_queue_groups
    await declare_broker_topology(settings)
    url = settings.amqp_url.get_secret_value()
    body = (
        b'{"v":1,"operation_id":"8d0a3c59-5c1e-4a8e-9d55-3f1b0d9a2c11","outbox_id":7,'
        b'"tool":"send_refund","tool_version":1,"input_fingerprint":"' + b"ab" * 32 + b'"}'
    )
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(settings.exchange)
        await exchange.publish(
            aio_pika.Message(body, message_id="outbox-7"), routing_key="send_refund.v1"
        )
        queue = await channel.get_queue(pay)

        async def rejected() -> bool:
            delivery = await queue.get(no_ack=False, fail=False)
            if delivery is None:
                return False
            # As the consumer does with a message past hope: the broker dead-letters it.
            await delivery.reject(requeue=False)
            return True

        await eventually(rejected, within=15, what="the message rejected from its queue")
    await eventually(
        lambda: _holds(settings, settings.dead_letter_queue, 1),
        within=15,
        what="the message dead-lettered",
    )
    monkeypatch.setenv("OUTBOX_AMQP_URL", url)
    monkeypatch.setenv("OUTBOX_EXCHANGE", settings.exchange)
    monkeypatch.setenv("OUTBOX_DEAD_LETTER_QUEUE", settings.dead_letter_queue)

    code = await asyncio.to_thread(run_command, ["dlq", "requeue", "--all"])

    assert code == 0, capsys.readouterr().err
    [back] = await read_raw(url, pay, expect=1)
    assert (back.body, back.routing_key) == (body, "send_refund.v1")
    assert await message_count(url, settings.queue) == 0
    assert await message_count(url, settings.dead_letter_queue) == 0
