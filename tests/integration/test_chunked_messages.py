"""Several operations per broker message (OUTBOX_MESSAGE_OPERATIONS), against the real
Postgres and RabbitMQ: fewer messages for the same effects, dedupe and every check
still per operation, and a poison entry that does not take its neighbours with it."""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import psycopg
from pydantic import SecretStr

from harness.proxy import TcpProxy, url_through
from outbox import OperationState, Registry, Settings
from outbox.broker import OperationChunk, OperationMessage, parse_body
from outbox.operator import dlq

from support.broker_helpers import read_raw
from support.consume_helpers import events, in_state, operation, publish_raw, running_consumer
from support.dispatch_helpers import counter_value, record_many, record_one, running_dispatcher
from support.sample_tools import Ledger
from support.waiting import eventually

S = OperationState
UNKNOWN = "00000000-0000-4000-8000-000000000000"


def chunked(settings: Settings, size: int = 8) -> Settings:
    return settings.model_copy(update={"message_operations": size, "reconcile_interval": 0.05})


def operation_ids(database_url: str) -> set[UUID]:
    with psycopg.connect(database_url) as connection:
        return {row[0] for row in connection.execute("SELECT id FROM operations")}


def entry(database_url: str, of: UUID, **changes: Any) -> dict[str, Any]:
    op = operation(database_url, of)
    fields: dict[str, Any] = {
        "operation_id": str(op.id),
        "outbox_id": 1,
        "tool": op.tool_name,
        "tool_version": op.tool_version,
        "input_fingerprint": op.input_fingerprint,
    }
    return {**fields, **changes}


def chunk_body(*entries: dict[str, Any]) -> bytes:
    return json.dumps({"v": 2, "operations": list(entries)}, separators=(",", ":")).encode()


def two_in_a_chunk(database_url: str, registry: Registry) -> tuple[UUID, UUID, bytes]:
    """Two refunds decided and the chunk that names both, as the dispatcher would send it."""
    first = record_one(database_url, registry, payment_id="pay_1")
    second = record_one(database_url, registry, payment_id="pay_2")
    return first, second, chunk_body(entry(database_url, first), entry(database_url, second))


async def test_a_batch_goes_out_as_chunks_that_name_each_operation_once(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    record_many(database_url, registry, 20)
    decided = operation_ids(database_url)

    async with running_dispatcher(chunked(settings)) as dispatcher:

        async def published() -> bool:
            return counter_value(dispatcher, "outbox_dispatcher_published_total") == 20

        await eventually(published, within=20, what="20 rows published")

    # A batch of 20 claimed at once is spread over four chunks of five.
    messages = await read_raw(amqp_server_url, settings.queue, expect=4)
    bodies = [parse_body(message.body) for message in messages]
    assert all(isinstance(body, OperationChunk) for body in bodies)
    sizes = sorted(len(body.operations) for body in bodies if isinstance(body, OperationChunk))
    assert sizes == [5, 5, 5, 5]
    named = [e.operation_id for b in bodies if isinstance(b, OperationChunk) for e in b.operations]
    assert sorted(named) == sorted(decided)
    assert len(messages) == 4


async def test_chunked_decisions_each_end_in_one_effect(
    settings: Settings, registry: Registry, ledger: Ledger, database_url: str
) -> None:
    record_many(database_url, registry, 20)
    decided = operation_ids(database_url)

    async with (
        running_dispatcher(chunked(settings)),
        running_consumer(chunked(settings), registry) as consumer,
    ):

        async def all_committed() -> bool:
            return (
                counter_value(consumer, "outbox_consumer_deliveries_total", result="processed")
                == 20
            )

        await eventually(all_committed, within=30, what="20 operations processed")

    assert sorted(ledger.calls) == sorted(str(op) for op in decided)
    for operation_id in decided:
        assert operation(database_url, operation_id).state is S.COMMITTED
        names = [event.name for event in events(database_url, operation_id)]
        assert names.count("operation.attempted") == 1
        assert names.count("operation.committed") == 1


async def test_a_poison_entry_is_dead_lettered_alone_and_its_neighbours_run(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    database_url: str,
    amqp_server_url: str,
) -> None:
    good = record_one(database_url, registry, payment_id="pay_good")
    lied_about = record_one(database_url, registry, payment_id="pay_other")
    body = chunk_body(
        entry(database_url, good),
        entry(database_url, good, operation_id=UNKNOWN),
        entry(database_url, lied_about, input_fingerprint="0" * 64),
    )
    async with running_consumer(chunked(settings), registry) as consumer:
        await publish_raw(amqp_server_url, settings.exchange, body)
        await eventually(in_state(database_url, good, S.COMMITTED), within=20, what="committed")

        def refused(reason: str) -> float:
            return counter_value(consumer, "outbox_consumer_dead_lettered_total", reason=reason)

        async def both_refused() -> bool:
            return refused("unknown_operation") == 1 and refused("envelope_mismatch") == 1

        await eventually(both_refused, within=20, what="both poison entries dead-lettered")
        sent_alone = counter_value(
            consumer, "outbox_consumer_deliveries_total", result="sent_alone"
        )
    assert sent_alone == 2
    # Each poison entry went round again as a message of its own and was dead-lettered
    # there, alone: the chunk itself was acknowledged for its good entry.
    assert await read_raw(amqp_server_url, settings.queue, expect=1, within=1.0) == []
    dead = await read_raw(amqp_server_url, settings.dead_letter_queue, expect=2)
    envelopes = [parse_body(message.body) for message in dead]
    assert all(isinstance(envelope, OperationMessage) for envelope in envelopes)
    assert sorted(str(e.operation_id) for e in envelopes if isinstance(e, OperationMessage)) == (
        sorted([UNKNOWN, str(lied_about)])
    )
    assert ledger.calls == [str(good)]
    # The operation the entry lied about was not touched: its own message runs it.
    assert operation(database_url, lied_about).state is S.PREPARED


async def test_a_chunk_with_nothing_that_can_run_is_dead_lettered_whole_and_listed(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    database_url: str,
    amqp_server_url: str,
) -> None:
    op = record_one(database_url, registry)
    body = chunk_body(
        entry(database_url, op, operation_id=UNKNOWN),
        entry(database_url, op, tool_version=7),
    )
    async with running_consumer(chunked(settings), registry) as consumer:
        await publish_raw(amqp_server_url, settings.exchange, body)

        def refused(reason: str) -> float:
            return counter_value(consumer, "outbox_consumer_dead_lettered_total", reason=reason)

        async def dead_lettered() -> bool:
            return refused("unknown_operation") == 1 and refused("envelope_mismatch") == 1

        await eventually(dead_lettered, within=20, what="both entries of the chunk counted")
        listing = None

        async def listed() -> bool:
            nonlocal listing
            listing = await dlq.list_dead_letters(settings)
            return len(listing.messages) == 1

        await eventually(listed, within=20, what="the chunk in the dead-letter queue")

    assert listing is not None
    dead = listing.messages[0]
    assert dead.parsed
    assert dead.envelope is None
    assert [e.operation_id for e in dead.chunk] == [UUID(UNKNOWN), op]
    assert dead.as_json()["body"] == "chunk"
    assert f"chunk of 2: operation_id={UNKNOWN}" in dead.line()
    assert ledger.calls == []
    assert operation(database_url, op).state is S.PREPARED


async def test_a_chunk_delivered_again_is_a_duplicate_for_every_entry(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    database_url: str,
    amqp_server_url: str,
) -> None:
    first, second, body = two_in_a_chunk(database_url, registry)
    async with running_consumer(chunked(settings), registry) as consumer:

        def count(result: str) -> float:
            return counter_value(consumer, "outbox_consumer_deliveries_total", result=result)

        await publish_raw(amqp_server_url, settings.exchange, body)

        async def processed() -> bool:
            return count("processed") == 2

        await eventually(processed, within=20, what="both entries processed")
        await publish_raw(amqp_server_url, settings.exchange, body)

        async def suppressed() -> bool:
            return count("duplicate") == 2

        await eventually(suppressed, within=20, what="both entries suppressed")

    assert sorted(ledger.calls) == sorted([str(first), str(second)])
    for operation_id in (first, second):
        names = [event.name for event in events(database_url, operation_id)]
        assert names.count("operation.committed") == 1
        assert names.count("operation.delivery_suppressed") == 1


async def test_a_chunk_the_database_cannot_take_goes_back_to_the_queue_whole(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    database_url: str,
    amqp_server_url: str,
    database_proxy: TcpProxy,
) -> None:
    first, second, body = two_in_a_chunk(database_url, registry)
    through_proxy = chunked(settings).model_copy(
        update={
            "database_url": SecretStr(
                url_through(settings.database_url.get_secret_value(), database_proxy.port)
            ),
            # A connect into the black hole gives up soon, so the stop below is not
            # held up by one.
            "db_connect_timeout": 2,
        }
    )
    async with running_consumer(through_proxy, registry) as consumer:
        database_proxy.blackhole()
        database_proxy.cut()
        await publish_raw(amqp_server_url, settings.exchange, body)

        async def held() -> bool:
            return counter_value(consumer, "outbox_consumer_deliveries_held_total") >= 2

        await eventually(held, within=30, what="the chunk's entries held in hand")
    # Stopping with the database still away: the chunk goes back, once, whole.
    assert counter_value(consumer, "outbox_consumer_deliveries_total", result="retry_later") == 2
    returned = await read_raw(amqp_server_url, settings.queue, expect=1)
    assert [message.body for message in returned] == [body]
    assert ledger.calls == []
    database_proxy.restore()
    for operation_id in (first, second):
        assert operation(database_url, operation_id).state is S.PREPARED
