"""Settling deliveries with as few frames as the broker allows.

A consumer under load finishes a burst of deliveries together (they share their claim
and their outcome transactions), and one ``basic.ack`` per delivery then costs a frame
for the client to build and write and for the broker to parse: as much CPU per operation
as the rest of the delivery path. One ``basic.ack`` with ``multiple`` settles every
delivery up to its tag, so :class:`Settlements` gathers what finished in the same turn of
the event loop and sends one multiple-ack for the run of consecutive tags it completes.

A multiple-ack must never reach past a delivery still in hand (it would be acked before
its outcome is recorded), so the run only extends over tags already settled: each
delivery's tag is known to be settled, waiting or in hand, and nothing is assumed about
the order in which handlers start or finish. Rejections and nacks go out first, one frame
each, so a later multiple-ack never covers a delivery that was meant to come back.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from consumer.deliveries import Settleable


class Settlement(enum.Enum):
    ACK = "ack"
    REJECT = "reject"  # dead-lettered: never redelivered
    REQUEUE = "requeue"  # nack with requeue: delivered again later


@dataclass
class _Waiting:
    message: Settleable
    how: Settlement
    settled: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Settlements:
    """Acks, rejections and nacks for the deliveries of one channel.

    :meth:`settle` returns once the frame that settles the delivery has been written
    (or raises what writing it raised), so a handler that returns has really settled
    its delivery, and a graceful stop that waits for the handlers sends every ack.
    """

    def __init__(self) -> None:
        # Every tag at or below this one is settled; deliveries start at tag 1.
        self._settled_through = 0
        # Settled tags above the mark: a gap (a delivery still in hand) keeps them there.
        self._settled_above: set[int] = set()
        self._waiting: list[_Waiting] = []
        self._flush_scheduled = False
        # The event loop keeps only weak references to tasks: a flush in progress is
        # held here until it ends, so it cannot be collected with its acks unsent.
        self._flushes: set[asyncio.Task[None]] = set()
        self.frames_sent = 0
        """How many settling frames went out: the saving is visible in tests."""

    async def settle(self, message: Settleable, how: Settlement) -> None:
        waiting = _Waiting(message, how)
        self._waiting.append(waiting)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # After the callbacks already ready: what else finishes in this turn of the
            # loop goes out in the same flush.
            asyncio.get_running_loop().call_soon(self._start_flush)
        await waiting.settled

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        waiting, self._waiting = self._waiting, []
        if waiting:
            flush = asyncio.get_running_loop().create_task(self._flush(waiting))
            self._flushes.add(flush)
            flush.add_done_callback(self._flushes.discard)

    async def _flush(self, waiting: list[_Waiting]) -> None:
        try:
            await self._send(waiting)
        except BaseException as failure:
            for item in waiting:
                if not item.settled.done():
                    item.settled.set_exception(failure)
            if not isinstance(failure, Exception):
                raise
            return
        for item in waiting:
            if not item.settled.done():
                item.settled.set_result(None)

    async def _send(self, waiting: list[_Waiting]) -> None:
        acks: dict[int, Settleable] = {}
        for item in waiting:
            tag = item.message.delivery_tag
            if tag is None:  # not from a consumer with acks: nothing to settle
                continue
            if item.how is Settlement.ACK:
                acks[tag] = item.message
                continue
            if item.how is Settlement.REJECT:
                await item.message.reject(requeue=False)
            else:
                await item.message.nack(requeue=True)
            self.frames_sent += 1
            self._mark_settled(tag)
        if not acks:
            return
        # The run of consecutive tags from the mark that these acks complete.
        through = self._settled_through
        while through + 1 in acks or through + 1 in self._settled_above:
            through += 1
        run = [tag for tag in acks if tag <= through]
        if len(run) > 1:
            await acks[max(run)].ack(multiple=True)
            self.frames_sent += 1
        elif run:
            await acks[run[0]].ack()
            self.frames_sent += 1
        for tag in run:
            self._mark_settled(tag)
        # Past a delivery still in hand: one frame each, never held back for it (an
        # unacked delivery counts against the prefetch, and the one in hand may be slow).
        for tag in sorted(acks.keys() - set(run)):
            await acks[tag].ack()
            self.frames_sent += 1
            self._mark_settled(tag)

    def _mark_settled(self, tag: int) -> None:
        self._settled_above.add(tag)
        while self._settled_through + 1 in self._settled_above:
            self._settled_through += 1
            self._settled_above.discard(self._settled_through)
