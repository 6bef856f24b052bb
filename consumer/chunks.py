"""Messages that carry several operations (chunks), each entry settled on its own.

A chunk's message is settled as soon as each of its entries has been claimed, refused or
sent round again alone: from its claim on, an operation is carried by its lease and the
reconciler, not by the message, so a slow entry no longer pins a prefetch slot worth the
whole chunk. Its call and record go on after the ack, and :class:`InHand` keeps them
bounded, as the prefetch bounded them while the message stayed unacknowledged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from consumer.acks import Settlement, Settlements
from consumer.claims import Claimed
from consumer.deliveries import Received
from consumer.telemetry import log
from outbox import tracing
from outbox.broker import BrokerUnavailable, ChunkEntry, OperationChunk, OperationMessage
from outbox.metrics import ConsumerMetrics

Resend = Callable[[ChunkEntry], Awaitable[None]]
"""Publishes a chunk's entry as a message of its own, confirmed."""


@dataclass(frozen=True)
class Handled:
    """What one operation's handling leaves for its message: a result label, why the
    message can never be right, or the database error that sends it back to the queue."""

    result: str
    dead_letter_reason: str | None = None
    returned: BaseException | None = None


@dataclass(frozen=True)
class Alone:
    """An entry of a chunk sent round again alone: its place in the chunk, and why
    (``poison``: the reason it can never run from this message; else the error its claim
    raised)."""

    position: int
    entry: ChunkEntry
    reason: str
    poison: bool


class Operating(Protocol):
    """What a chunk's entries need of the consumer: each entry is a delivery of its own."""

    async def claim_entry(self, envelope: OperationMessage) -> Claimed | Handled: ...

    async def finish(self, claimed: Claimed, traceparent: str | None) -> Handled: ...

    async def dead_letter(
        self, message: Received, settlements: Settlements, *reasons: str
    ) -> str: ...

    def log_returned(self, error: BaseException) -> None: ...


class InHand:
    """The operations of acknowledged chunks still being called or recorded, at most
    ``capacity()`` (the prefetch times the operations a message may carry): a chunk
    whose entries would go past it waits, unacknowledged, before its claims, which is the
    backpressure the broker's prefetch gives a single message. A chunk is always taken
    when nothing is in hand, however large, so a narrowed limit cannot stall it."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self._capacity = capacity
        self._count = 0
        self._changed = asyncio.Condition()

    @property
    def count(self) -> int:
        return self._count

    async def take(self, entries: int) -> None:
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._count == 0 or self._count + entries <= self._capacity()
            )
            self._count += entries

    async def give_back(self, entries: int = 1) -> None:
        async with self._changed:
            self._count -= entries
            self._changed.notify_all()


class Chunks:
    """Handles the messages that carry several operations."""

    def __init__(self, operating: Operating, metrics: ConsumerMetrics, in_hand: InHand) -> None:
        self._operating = operating
        self.metrics = metrics
        self._in_hand = in_hand

    async def handle(
        self,
        message: Received,
        settlements: Settlements,
        chunk: OperationChunk,
        resend: Resend | None,
    ) -> str:
        """Every operation of a chunk, each as a delivery of its own (their claims and
        outcomes share transactions), the message settled as soon as each entry is
        claimed or settled alone.

        A claimed entry is carried by its lease and the reconciler from then on, so the
        message is acknowledged before the calls end and a slow entry holds nobody's
        acknowledgement; :class:`consumer.chunks.InHand` bounds what runs on after it.
        An entry that can never run from this message (poison), or whose claim raised,
        is sent round again as a message of its own, confirmed before the chunk is
        acknowledged: it meets its own ending there, dead-lettered alone, without its
        neighbours. A chunk whose every entry is poison goes to the dead-letter queue
        whole, and one with an entry the database could not take goes back to the
        queue whole, where its claimed entries are duplicates."""
        entries = chunk.operations
        await self._in_hand.take(len(entries))
        loop = asyncio.get_running_loop()
        claimed: list[asyncio.Future[Claimed | Handled | Exception]] = [
            loop.create_future() for _ in entries
        ]
        # Each entry is called as soon as its own claim commits, whatever becomes of the
        # message: one waiting for its turn under a declared rate holds up no other.
        running = [
            asyncio.create_task(self._run_entry(entry, told))
            for entry, told in zip(entries, claimed, strict=True)
        ]
        try:
            claims = await asyncio.gather(*claimed, return_exceptions=True)
            alone: list[Alone] = []
            returned: list[BaseException] = []
            for position, (entry, claim) in enumerate(zip(entries, claims, strict=True)):
                if isinstance(claim, Claimed):
                    continue
                if isinstance(claim, BaseException):
                    if not isinstance(claim, Exception):
                        raise claim
                    alone.append(Alone(position, entry, type(claim).__name__, poison=False))
                elif claim.returned is not None:
                    returned.append(claim.returned)
                elif claim.dead_letter_reason is not None:
                    alone.append(Alone(position, entry, claim.dead_letter_reason, poison=True))
                else:
                    self.metrics.deliveries.labels(claim.result).inc()
            if len(alone) == len(entries) and all(each.poison for each in alone):
                return await self._operating.dead_letter(
                    message, settlements, *(each.reason for each in alone)
                )
            if returned:
                self.metrics.deliveries.labels("retry_later").inc(len(returned))
            else:
                returned.extend(await self._send_alone(message, alone, resend))
            if returned:
                self._operating.log_returned(returned[0])
                await settlements.settle(message, Settlement.REQUEUE)
            else:
                await settlements.settle(message, Settlement.ACK)
        finally:
            # The claimed entries' calls and records finish even if settling failed: an
            # unacknowledged chunk comes back, and they are duplicates then.
            await asyncio.gather(*running, return_exceptions=True)
        return "chunk"

    async def _run_entry(
        self, entry: ChunkEntry, claimed: asyncio.Future[Claimed | Handled | Exception]
    ) -> None:
        """One entry: its claim, told to the chunk as soon as it is known, then, if
        claimed, its call and record; its place in hand given back when it ends."""
        try:
            try:
                claim = await self._operating.claim_entry(entry)
            except Exception as error:
                claimed.set_result(error)
                return
            except BaseException:
                claimed.cancel()
                raise
            claimed.set_result(claim)
            if isinstance(claim, Claimed):
                await self._finish_entry(claim, entry)
        finally:
            await self._in_hand.give_back()

    async def _send_alone(
        self,
        message: Received,
        alone: list[Alone],
        resend: Resend | None,
    ) -> list[BaseException]:
        """Send each entry of ``alone`` round again as a message of its own, each confirmed;
        the error that stopped it (and returns the chunk to the queue whole), if any."""
        for each in alone:
            why = {"reason": each.reason} if each.poison else {"error": each.reason}
            log(
                logging.WARNING,
                "consumer.chunk_entry_sent_alone",
                "an operation of a chunk could not be settled with it; it goes round "
                "again as a message of its own, and its neighbours went on",
                message_id=safe_message_id(message.message_id),
                position=each.position,
                **why,
            )
        if not alone:
            return []
        if resend is None:
            return [BrokerUnavailable("no broker session to send an entry alone on")]
        try:
            await asyncio.gather(*(resend(each.entry) for each in alone))
        except Exception as error:
            return [error]
        self.metrics.deliveries.labels("sent_alone").inc(len(alone))
        return []

    async def _finish_entry(self, claimed: Claimed, entry: ChunkEntry) -> None:
        """A claimed entry of an acknowledged chunk: its call and record, counted; an
        error is logged, and its lease hands the operation to the reconciler."""
        try:
            handled = await self._operating.finish(
                claimed, tracing.valid_traceparent(entry.traceparent)
            )
        except Exception as error:
            log(
                logging.ERROR,
                "consumer.chunk_entry_failed",
                "recording an operation of an acknowledged chunk failed; the reconciler "
                "takes it when its lease runs out",
                error=type(error).__name__,
            )
            handled = Handled("retry_later")
        self.metrics.deliveries.labels(handled.result).inc()


def safe_message_id(value: str | None) -> str:
    if value and len(value) <= 64 and value.replace("-", "").replace("_", "").isalnum():
        return value
    return "-"
