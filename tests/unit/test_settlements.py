"""consumer.acks.Settlements: one multiple-ack for a run of finished deliveries, never
reaching past one still in hand, rejections and nacks first."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from aio_pika.abc import AbstractIncomingMessage

from consumer.acks import Settlement, Settlements

Frames = list[tuple[str, int, bool]]


class FakeDelivery:
    """Records the settling frames it is asked to send, in one list shared by a channel."""

    def __init__(self, tag: int, frames: Frames, *, failure: Exception | None = None) -> None:
        self.delivery_tag = tag
        self._frames = frames
        self._failure = failure

    async def ack(self, multiple: bool = False) -> None:
        if self._failure is not None:
            raise self._failure
        self._frames.append(("ack", self.delivery_tag, multiple))

    async def reject(self, requeue: bool = False) -> None:
        assert not requeue
        self._frames.append(("reject", self.delivery_tag, False))

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        assert requeue
        assert not multiple
        self._frames.append(("requeue", self.delivery_tag, False))


def delivery(tag: int, frames: Frames, failure: Exception | None = None) -> AbstractIncomingMessage:
    return cast(AbstractIncomingMessage, FakeDelivery(tag, frames, failure=failure))


async def settle_together(
    settlements: Settlements, items: list[tuple[AbstractIncomingMessage, Settlement]]
) -> None:
    """Settle several deliveries in the same turn of the event loop, as a burst does."""
    await asyncio.gather(*(settlements.settle(message, how) for message, how in items))


async def test_a_burst_of_acks_is_one_multiple_ack() -> None:
    frames: Frames = []
    settlements = Settlements()
    await settle_together(
        settlements, [(delivery(tag, frames), Settlement.ACK) for tag in (3, 1, 5, 2, 4)]
    )
    assert frames == [("ack", 5, True)]
    assert settlements.frames_sent == 1


async def test_a_lone_ack_is_a_single_ack() -> None:
    frames: Frames = []
    settlements = Settlements()
    await settlements.settle(delivery(1, frames), Settlement.ACK)
    await settlements.settle(delivery(2, frames), Settlement.ACK)
    assert frames == [("ack", 1, False), ("ack", 2, False)]


async def test_acks_never_reach_past_a_delivery_still_in_hand() -> None:
    frames: Frames = []
    settlements = Settlements()
    # Tag 3 is still being handled: 1 and 2 go in one frame, 4 and 5 one frame each,
    # since a multiple-ack of 5 would settle 3 before its outcome is recorded.
    await settle_together(
        settlements, [(delivery(tag, frames), Settlement.ACK) for tag in (1, 2, 4, 5)]
    )
    assert frames == [("ack", 2, True), ("ack", 4, False), ("ack", 5, False)]
    # Once 3 finishes, the run continues past the ones acked on their own.
    frames.clear()
    await settle_together(
        settlements, [(delivery(tag, frames), Settlement.ACK) for tag in (3, 6, 7)]
    )
    assert frames == [("ack", 7, True)]


async def test_rejections_and_requeues_go_first_and_acks_cover_the_rest() -> None:
    frames: Frames = []
    settlements = Settlements()
    await settle_together(
        settlements,
        [
            (delivery(1, frames), Settlement.ACK),
            (delivery(2, frames), Settlement.REJECT),
            (delivery(3, frames), Settlement.ACK),
            (delivery(4, frames), Settlement.REQUEUE),
            (delivery(5, frames), Settlement.ACK),
        ],
    )
    # The multiple-ack of 5 covers 1, 3 and 5 only: 2 and 4 were settled before it.
    assert frames == [("reject", 2, False), ("requeue", 4, False), ("ack", 5, True)]


async def test_a_failed_write_raises_in_every_delivery_of_its_flush() -> None:
    frames: Frames = []
    settlements = Settlements()
    lost = ConnectionError("channel closed")
    results = await asyncio.gather(
        settlements.settle(delivery(1, frames), Settlement.ACK),
        settlements.settle(delivery(2, frames, failure=lost), Settlement.ACK),
        return_exceptions=True,
    )
    assert list(results) == [lost, lost]
    assert frames == []


class SlowDelivery(FakeDelivery):
    """An ack whose write has started and waits to be let through."""

    def __init__(self, tag: int, frames: Frames) -> None:
        super().__init__(tag, frames)
        self.writing = asyncio.Event()
        self.written = asyncio.Event()

    async def ack(self, multiple: bool = False) -> None:
        self.writing.set()
        await self.written.wait()
        await super().ack(multiple)


async def test_settle_returns_only_once_its_frame_is_written() -> None:
    frames: Frames = []
    settlements = Settlements()
    slow = SlowDelivery(1, frames)
    settling = asyncio.ensure_future(
        settlements.settle(cast(AbstractIncomingMessage, slow), Settlement.ACK)
    )
    await asyncio.wait_for(slow.writing.wait(), timeout=5)
    assert not settling.done()
    slow.written.set()
    await asyncio.wait_for(settling, timeout=5)
    assert frames == [("ack", 1, False)]


@pytest.mark.parametrize("how", [Settlement.REJECT, Settlement.REQUEUE])
async def test_a_run_stalled_by_an_unsettled_tag_resumes_after_it(how: Settlement) -> None:
    frames: Frames = []
    settlements = Settlements()
    await settlements.settle(delivery(2, frames), Settlement.ACK)
    await settlements.settle(delivery(1, frames), how)
    await settle_together(settlements, [(delivery(tag, frames), Settlement.ACK) for tag in (3, 4)])
    assert frames[-1] == ("ack", 4, True)
