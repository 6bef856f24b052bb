"""``outbox dlq list`` and ``outbox dlq requeue`` against the real broker.

Messages reach the dead-letter queue the way they do in production: a consumer on the
operations queue rejects them without requeue, so the broker writes a genuine x-death.
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import Awaitable, Callable

import aio_pika
import pytest
from pydantic import SecretStr

from outbox import Registry
from outbox import store as outbox_store
from outbox.broker import OperationMessage, Topology, declare_topology, message_id
from outbox.cli import run_command
from outbox.operator import dlq
from outbox.settings import Settings
from outbox.states import EventName

from support.broker_helpers import read_raw
from support.console_helpers import dead_letter_one
from support.ops_helpers import Ops
from support.waiting import eventually

CANARY = "CANARY-7f3a-do-not-print"
POISON = f'{{"secret": "{CANARY}", "card": "4242 4242 4242 4242"}}'.encode()
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

Cli = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
async def broker(amqp_server_url: str, broker_names: Topology) -> Settings:
    """This test's own topology, declared as the daemons declare it (no database needed)."""
    settings = Settings(
        amqp_url=SecretStr(amqp_server_url),
        exchange=broker_names.exchange,
        queue=broker_names.queue,
        dead_letter_exchange=broker_names.dead_letter_exchange,
        dead_letter_queue=broker_names.dead_letter_queue,
    )
    connection = await aio_pika.connect(amqp_server_url)
    async with connection:
        await declare_topology(await connection.channel(), Topology.from_settings(settings))
    return settings


@pytest.fixture
def cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], broker: Settings
) -> Cli:
    """Runs ``outbox dlq ...`` as the command line does, with the names in the environment;
    returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("OUTBOX_AMQP_URL", broker.amqp_url.get_secret_value())
    monkeypatch.setenv("OUTBOX_EXCHANGE", broker.exchange)
    monkeypatch.setenv("OUTBOX_DEAD_LETTER_QUEUE", broker.dead_letter_queue)

    async def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        # run_command starts its own event loop, which cannot nest in the test's.
        code = await asyncio.to_thread(run_command, ["dlq", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def envelope(outbox_id: int) -> bytes:
    return (
        OperationMessage(
            operation_id=uuid.uuid4(),
            outbox_id=outbox_id,
            tool="send_refund",
            tool_version=1,
            input_fingerprint="ab" * 32,
        )
        .model_dump_json()
        .encode()
    )


def message(body: bytes, message_id: str | None) -> aio_pika.Message:
    return aio_pika.Message(
        body,
        message_id=message_id,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        headers={"traceparent": TRACEPARENT},
    )


async def ready_count(amqp_url: str, queue: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        declared = await (await connection.channel()).get_queue(queue)
        return declared.declaration_result.message_count or 0


async def holds(amqp_url: str, queue: str, expected: int) -> None:
    async def check() -> bool:
        return await ready_count(amqp_url, queue) == expected

    await eventually(check, within=15, what=f"{expected} message(s) ready in {queue}")


async def dead_letter(settings: Settings, *messages: aio_pika.Message) -> None:
    """Publish to the operations exchange, then reject each delivery without requeue from
    a consumer on the operations queue, as the consumer does with poison."""
    url = settings.amqp_url.get_secret_value()
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(settings.exchange)
        for each in messages:
            await exchange.publish(each, routing_key="send_refund.v1", mandatory=True)
        queue = await channel.get_queue(settings.queue)
        rejected = 0

        async def all_rejected() -> bool:
            nonlocal rejected
            while (delivery := await queue.get(no_ack=False, fail=False)) is not None:
                await delivery.reject(requeue=False)
                rejected += 1
            return rejected == len(messages)

        await eventually(all_rejected, within=15, what="every message rejected")
    await holds(url, settings.dead_letter_queue, len(messages))


def refused_port() -> int:
    """A local port nothing listens on: bound once to find it free, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_list_shows_why_without_the_poison_body_and_loses_nothing(
    broker: Settings, cli: Cli, amqp_server_url: str
) -> None:
    valid = envelope(7)
    # The id is a publisher's choice too: one with a line break is described, not printed.
    await dead_letter(broker, message(POISON, f"evil\n{CANARY}"), message(valid, message_id(7)))

    code, out, err = await cli("list")

    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"dead-lettered: 2 message(s) in {broker.dead_letter_queue}"
    parsed = OperationMessage.model_validate_json(valid)
    [good] = [line for line in lines if "message_id=outbox-7" in line]
    assert f"operation_id={parsed.operation_id} tool=send_refund tool_version=1" in good
    assert f"x-death: reason=rejected queue={broker.queue} count=1" in good
    assert good.endswith("x-first-death-reason=rejected")
    [poison] = [line for line in lines if "unparseable" in line]
    assert f"body: unparseable ({len(POISON)} bytes)" in poison
    assert "message_id=(not shown: " in poison
    assert "reason=rejected" in poison
    assert CANARY not in out + err
    # The card's groups with their space: four hex digits alone turn up in a random
    # operation id now and then.
    assert "4242 4242" not in out + err

    # Listing is a snapshot: both are still there, with their bodies intact.
    await holds(amqp_server_url, broker.dead_letter_queue, 2)
    kept = await read_raw(amqp_server_url, broker.dead_letter_queue, expect=2)
    assert sorted(m.body for m in kept) == sorted([POISON, valid])


async def test_list_json_parses_and_names_the_reason(broker: Settings, cli: Cli) -> None:
    valid = envelope(3)
    await dead_letter(broker, message(POISON, "poison-1"), message(valid, message_id(3)))

    code, out, err = await cli("list", "--json")

    assert code == 0, err
    listing = json.loads(out)
    assert listing["queue"] == broker.dead_letter_queue
    assert listing["count"] == listing["shown"] == 2
    by_id = {m["message_id"]: m for m in listing["messages"]}
    assert by_id["outbox-3"]["envelope"] == {
        "operation_id": str(OperationMessage.model_validate_json(valid).operation_id),
        "tool": "send_refund",
        "tool_version": 1,
    }
    assert by_id["poison-1"]["envelope"] is None
    assert by_id["poison-1"]["body"] == "unparseable"
    assert by_id["poison-1"]["body_bytes"] == len(POISON)
    for each in by_id.values():
        assert each["deaths"] == [{"reason": "rejected", "queue": broker.queue, "count": 1}]
        assert each["first_death_reason"] == "rejected"
        assert each["routing_key"] == "send_refund.v1"
    assert CANARY not in out + err


async def test_list_limit_shows_the_head_and_counts_all(
    broker: Settings, cli: Cli, amqp_server_url: str
) -> None:
    await dead_letter(broker, *(message(envelope(i), message_id(i)) for i in (1, 2, 3)))

    code, out, err = await cli("list", "--limit", "1")

    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"dead-lettered: 3 message(s) in {broker.dead_letter_queue}"
    assert sum("message_id=" in line for line in lines) == 1
    assert lines[-1] == "(showing 1; --limit N shows more)"
    await holds(amqp_server_url, broker.dead_letter_queue, 3)


async def test_requeue_all_sends_envelopes_back_and_leaves_poison(
    broker: Settings, cli: Cli, amqp_server_url: str
) -> None:
    valid = envelope(11)
    await dead_letter(broker, message(POISON, "poison-1"), message(valid, message_id(11)))

    code, out, err = await cli("requeue", "--all")

    assert code == 0, err
    assert out.splitlines()[0] == "requeued 1, left 1 (unparseable), kept 0 (not selected)"
    assert CANARY not in out + err
    [back] = await read_raw(amqp_server_url, broker.queue, expect=1)
    assert back.body == valid
    assert back.message_id == "outbox-11"
    assert back.routing_key == "send_refund.v1"
    headers = back.headers or {}
    assert headers.get("traceparent") == TRACEPARENT
    assert "x-death" not in headers  # a new trip: the broker writes a fresh one if it dies
    await holds(amqp_server_url, broker.dead_letter_queue, 1)
    [left] = await read_raw(amqp_server_url, broker.dead_letter_queue, expect=1)
    assert left.body == POISON


async def test_requeue_by_message_id_moves_only_that_one(
    broker: Settings, cli: Cli, amqp_server_url: str
) -> None:
    chosen = envelope(21)
    await dead_letter(
        broker,
        message(envelope(20), message_id(20)),
        message(chosen, message_id(21)),
        message(POISON, "poison-1"),
    )

    code, out, err = await cli("requeue", "--message-id", "outbox-21", "outbox-404")

    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "requeued 1, left 0 (unparseable), kept 2 (not selected)"
    assert f"not found in {broker.dead_letter_queue}: outbox-404" in lines
    [back] = await read_raw(amqp_server_url, broker.queue, expect=1)
    assert back.body == chosen
    await holds(amqp_server_url, broker.dead_letter_queue, 2)
    kept = await read_raw(amqp_server_url, broker.dead_letter_queue, expect=2)
    assert sorted(m.message_id or "" for m in kept) == ["outbox-20", "poison-1"]


async def test_requeue_limit_stops_after_n(
    broker: Settings, cli: Cli, amqp_server_url: str
) -> None:
    await dead_letter(broker, *(message(envelope(i), message_id(i)) for i in (1, 2, 3)))

    code, out, err = await cli("requeue", "--all", "--limit", "2")

    assert code == 0, err
    assert out.splitlines()[0] == "requeued 2, left 0 (unparseable), kept 0 (not selected)"
    assert len(await read_raw(amqp_server_url, broker.queue, expect=2)) == 2
    await holds(amqp_server_url, broker.dead_letter_queue, 1)


async def test_requeue_walks_window_after_window_and_stops_at_the_limit(
    broker: Settings, cli: Cli, amqp_server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two envelopes a window: the limit falls inside the second window, and poison met
    # on the way is passed over without taking a place in either.
    monkeypatch.setattr(dlq, "REQUEUE_WINDOW", 2)
    await dead_letter(
        broker,
        message(envelope(1), message_id(1)),
        message(POISON, "poison-1"),
        message(envelope(2), message_id(2)),
        message(envelope(3), message_id(3)),
        message(POISON, "poison-2"),
        message(envelope(4), message_id(4)),
        message(envelope(5), message_id(5)),
    )

    code, out, err = await cli("requeue", "--all", "--limit", "3")

    assert code == 0, err
    assert out.splitlines()[0] == "requeued 3, left 1 (unparseable), kept 0 (not selected)"
    back = await read_raw(amqp_server_url, broker.queue, expect=3)
    assert sorted(m.message_id or "" for m in back) == [message_id(i) for i in (1, 2, 3)]
    await holds(amqp_server_url, broker.dead_letter_queue, 4)
    left = await read_raw(amqp_server_url, broker.dead_letter_queue, expect=4)
    assert sorted(m.message_id or "" for m in left) == [
        message_id(4),
        message_id(5),
        "poison-1",
        "poison-2",
    ]


async def test_an_empty_dead_letter_queue(broker: Settings, cli: Cli) -> None:
    code, out, err = await cli("list")
    assert (code, out) == (0, f"dead-lettered: 0 message(s) in {broker.dead_letter_queue}\n")

    code, out, err = await cli("list", "--json")
    assert code == 0, err
    assert json.loads(out)["count"] == 0

    code, out, err = await cli("requeue", "--all")
    assert code == 0, err
    assert out == "requeued 0, left 0 (unparseable), kept 0 (not selected)\n"


async def test_a_missing_dead_letter_queue_is_named_and_not_created(
    broker: Settings, cli: Cli, amqp_server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = f"{broker.dead_letter_queue}.typo"
    monkeypatch.setenv("OUTBOX_DEAD_LETTER_QUEUE", missing)

    for argv in (["list"], ["requeue", "--all"]):
        code, out, err = await cli(*argv)
        assert code == 2
        assert out == ""
        assert f"dead-letter queue {missing!r} does not exist" in err
        assert "outbox migrate --broker" in err

    connection = await aio_pika.connect(amqp_server_url)
    async with connection:
        with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
            await (await connection.channel()).get_queue(missing)


async def test_a_missing_exchange_requeues_nothing(
    broker: Settings, cli: Cli, amqp_server_url: str
) -> None:
    await dead_letter(broker, message(envelope(5), message_id(5)))

    code, out, err = await cli("requeue", "--all", "--exchange", f"{broker.exchange}.typo")

    assert (code, out) == (2, "")
    assert f"exchange '{broker.exchange}.typo' does not exist" in err
    await holds(amqp_server_url, broker.dead_letter_queue, 1)


async def test_an_unroutable_requeue_is_refused_and_the_message_stays(
    broker: Settings, cli: Cli, amqp_server_url: str
) -> None:
    await dead_letter(broker, message(envelope(6), message_id(6)))
    connection = await aio_pika.connect(amqp_server_url)
    async with connection:  # nothing receives from the exchange any more
        channel = await connection.channel()
        queue = await channel.get_queue(broker.queue)
        await queue.unbind(broker.exchange, routing_key="#")

    code, out, err = await cli("requeue", "--all")

    assert (code, out) == (1, "")
    assert "did not confirm 1 republished message(s) (unroutable)" in err
    await holds(amqp_server_url, broker.dead_letter_queue, 1)
    [kept] = await read_raw(amqp_server_url, broker.dead_letter_queue, expect=1)
    assert kept.message_id == "outbox-6"


async def test_an_unreachable_broker_exits_1_with_one_line(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = refused_port()
    monkeypatch.setenv("OUTBOX_AMQP_URL", f"amqp://guest:sekret@127.0.0.1:{port}/")

    code, out, err = await cli("list")

    # A service that is down, not a setting that is wrong: 1, as for any other failure.
    assert code == 1
    assert out == ""
    assert err.splitlines() == [
        f"outbox dlq: error: cannot connect to amqp://guest:***@127.0.0.1:{port}/: "
        "AMQPConnectionError. Is RabbitMQ running, and is OUTBOX_AMQP_URL right?"
    ]
    assert "sekret" not in err


async def test_requeue_needs_a_selection(cli: Cli, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_command(["dlq", "requeue"])
    assert exit_.value.code == 2
    assert "one of the arguments --all --message-id is required" in capsys.readouterr().err


async def test_list_says_why_each_died_and_which_operation_is_already_escalated(
    settings: Settings,
    database_url: str,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It said only "reason=rejected count=1", and an operation escalated as undeliverable
    # left its dead letter with no hint: the console's dead-letter page said both.
    ops = Ops(database_url, registry)
    undeliverable = ops.escalated_at_claim("undeliverable")
    no_tool = ops.new()
    ops.run(outbox_store.append_event(no_tool, EventName.DEAD_LETTERED, {"reason": "unknown_tool"}))
    for operation, outbox_id in ((undeliverable, 1), (no_tool, 2)):
        await dead_letter_one(
            settings,
            OperationMessage(
                operation_id=operation.id,
                outbox_id=outbox_id,
                tool=operation.tool_name,
                tool_version=operation.tool_version,
                input_fingerprint=operation.input_fingerprint,
            ),
            message_id=message_id(outbox_id),
        )
    monkeypatch.setenv("OUTBOX_AMQP_URL", settings.amqp_url.get_secret_value())
    monkeypatch.setenv("OUTBOX_DEAD_LETTER_QUEUE", settings.dead_letter_queue)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)

    def listed(*flags: str) -> str:
        capsys.readouterr()
        assert run_command(["dlq", "list", *flags]) == 0
        out, err = capsys.readouterr()
        assert err == ""
        return out

    out = await asyncio.to_thread(listed)

    blocks = {block.split(" ", 1)[0]: block for block in out.split("\nmessage_id=")[1:]}
    escalated, refused = blocks["outbox-1"], blocks["outbox-2"]
    assert "\n  why: refused by a consumer, 1 time(s), from " in escalated
    assert "\n  its operation is escalated (undeliverable, " in escalated
    assert "a requeued copy would only be acknowledged" in escalated
    assert "\n  why: unknown_tool" in refused
    assert "escalated" not in refused

    document = json.loads(await asyncio.to_thread(listed, "--json"))
    by_id = {m["message_id"]: m for m in document["messages"]}
    assert by_id["outbox-1"]["operation_state"] == "escalated"
    assert by_id["outbox-1"]["escalation"]["reason"] == "undeliverable"
    assert by_id["outbox-2"]["why"] == "unknown_tool"
    assert by_id["outbox-2"]["escalation"] is None
