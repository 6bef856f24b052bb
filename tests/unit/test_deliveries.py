"""consumer.deliveries.Delivery: the fields the consumer reads, taken from the frame as
delivered, and settling frames sent on the delivering channel at most once."""

from __future__ import annotations

from typing import Any, cast

import aiormq.exceptions
import pytest
from aiormq.abc import AbstractChannel, DeliveredMessage

from bench.deliveries import dispatch, synthetic
from bench.deliveries import main as bench_main
from consumer.deliveries import AlreadySettled, Delivery


class RecordingChannel:
    """Records the settling calls aiormq would turn into frames; closed, it refuses them
    as aiormq's channel does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.is_closed = False

    def _record(self, name: str, **arguments: Any) -> None:
        if self.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError("closed")
        self.calls.append((name, arguments))

    async def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self._record("ack", delivery_tag=delivery_tag, multiple=multiple)

    async def basic_reject(self, delivery_tag: int, *, requeue: bool = True) -> None:
        self._record("reject", delivery_tag=delivery_tag, requeue=requeue)

    async def basic_nack(
        self, delivery_tag: int, multiple: bool = False, requeue: bool = True
    ) -> None:
        self._record("nack", delivery_tag=delivery_tag, multiple=multiple, requeue=requeue)


def delivered(
    channel: RecordingChannel,
    *,
    tag: int = 7,
    headers: dict[str, Any] | None = None,
    message_id: str | None = None,
) -> DeliveredMessage:
    return synthetic(
        tag, channel=cast(AbstractChannel, channel), headers=headers, message_id=message_id
    )


def test_a_delivery_carries_the_frame_s_body_tag_headers_and_message_id() -> None:
    channel = RecordingChannel()
    delivery = Delivery(
        delivered(channel, tag=12, headers={"traceparent": "00-ab"}, message_id="outbox-9")
    )
    assert delivery.body == b'{"v":1}'
    assert delivery.delivery_tag == 12
    assert delivery.headers == {"traceparent": "00-ab"}
    assert delivery.message_id == "outbox-9"


def test_a_delivery_without_headers_or_message_id_reads_none() -> None:
    properties_without = synthetic(3)
    properties_without.header.properties.message_id = None
    delivery = Delivery(properties_without)
    assert delivery.headers is None
    assert delivery.message_id is None


@pytest.mark.parametrize(
    ("settle", "expected"),
    [
        (lambda d: d.ack(), ("ack", {"delivery_tag": 7, "multiple": False})),
        (lambda d: d.ack(multiple=True), ("ack", {"delivery_tag": 7, "multiple": True})),
        (lambda d: d.reject(), ("reject", {"delivery_tag": 7, "requeue": False})),
        (
            lambda d: d.nack(),
            ("nack", {"delivery_tag": 7, "multiple": False, "requeue": True}),
        ),
    ],
    ids=["ack", "multiple-ack", "reject", "nack"],
)
async def test_each_settlement_is_one_call_on_the_delivering_channel(
    settle: Any, expected: tuple[str, dict[str, Any]]
) -> None:
    channel = RecordingChannel()
    await settle(Delivery(delivered(channel)))
    assert channel.calls == [expected]


async def test_a_second_settlement_is_refused_before_anything_is_sent() -> None:
    channel = RecordingChannel()
    delivery = Delivery(delivered(channel))
    await delivery.ack()
    with pytest.raises(AlreadySettled, match="already settled"):
        await delivery.nack()
    with pytest.raises(AlreadySettled):
        await delivery.ack()
    assert channel.calls == [("ack", {"delivery_tag": 7, "multiple": False})]


async def test_a_refused_second_settlement_is_an_amqp_error_the_consumer_already_handles() -> None:
    # consumer.worker treats an AMQPError from settling as "the redelivery will be a
    # duplicate", as it did for aio-pika's MessageProcessError.
    assert issubclass(AlreadySettled, aiormq.exceptions.AMQPError)


async def test_a_closed_channel_refuses_the_settlement() -> None:
    channel = RecordingChannel()
    delivery = Delivery(delivered(channel))
    channel.is_closed = True
    with pytest.raises(aiormq.exceptions.ChannelInvalidStateError):
        await delivery.ack()
    assert channel.calls == []


@pytest.mark.parametrize("path", ["queue.consume", "raw"])
@pytest.mark.parametrize("burst", [1, 7])
async def test_the_bench_hands_every_delivery_to_a_handler_on_both_paths(
    path: str, burst: int
) -> None:
    # bench.deliveries raises when a path loses a delivery; a figure must count them all.
    spent = await dispatch(path, [synthetic(tag) for tag in range(1, 51)], burst)
    assert spent > 0


@pytest.mark.parametrize("option", ["--deliveries", "--rounds", "--burst"])
def test_the_bench_refuses_a_count_below_one(
    option: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["deliveries.py", option, "0"])
    with pytest.raises(SystemExit) as exited:
        bench_main()
    assert exited.value.code == 2
    assert f"argument {option}: must be 1 or more" in capsys.readouterr().err
