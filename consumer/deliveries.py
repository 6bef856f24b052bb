"""A delivery as the consumer reads it: the fields it uses and the frames that settle it.

aio-pika's ``IncomingMessage`` decodes every property on construction (timestamp,
expiration, a lock check on each attribute it sets), about 23 µs a message on the
benchmark machine (``python -m bench.deliveries``); the consumer reads four fields.
A :class:`Delivery` keeps those and settles through the channel it came on, with the same
refusals: a closed channel raises, and a delivery is settled at most once.
"""

from __future__ import annotations

from typing import Any, Protocol

import aiormq.exceptions
from aiormq.abc import DeliveredMessage


class Settleable(Protocol):
    """What :class:`consumer.acks.Settlements` needs of a delivery (aio-pika's
    ``IncomingMessage`` is one too)."""

    @property
    def delivery_tag(self) -> int | None: ...

    async def ack(self, multiple: bool = False) -> None: ...

    async def reject(self, requeue: bool = False) -> None: ...

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None: ...


class Received(Settleable, Protocol):
    """What the consumer reads of a delivery besides settling it."""

    @property
    def body(self) -> bytes: ...

    @property
    def headers(self) -> dict[str, Any] | None: ...

    @property
    def message_id(self) -> str | None: ...


class AlreadySettled(aiormq.exceptions.AMQPError):
    """A second settlement of one delivery: the broker would close the channel for it
    (an unknown delivery tag), so it is refused before it is sent."""


class Delivery:
    """One message the broker delivered to this consumer, not yet acknowledged."""

    __slots__ = ("_channel", "_settled", "body", "delivery_tag", "headers", "message_id")

    def __init__(self, delivered: DeliveredMessage) -> None:
        properties = delivered.header.properties
        self._channel = delivered.channel
        self._settled = False
        self.body: bytes = delivered.body
        self.delivery_tag: int | None = delivered.delivery_tag
        self.headers: dict[str, Any] | None = properties.headers
        self.message_id: str | None = properties.message_id

    def _take(self) -> int:
        if self._settled:
            raise AlreadySettled(f"delivery {self.delivery_tag} is already settled")
        if self.delivery_tag is None:  # only a basic.get's empty answer has none
            raise AlreadySettled("a delivery without a tag cannot be settled")
        self._settled = True
        return self.delivery_tag

    async def ack(self, multiple: bool = False) -> None:
        await self._channel.basic_ack(delivery_tag=self._take(), multiple=multiple)

    async def reject(self, requeue: bool = False) -> None:
        await self._channel.basic_reject(delivery_tag=self._take(), requeue=requeue)

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        await self._channel.basic_nack(
            delivery_tag=self._take(), multiple=multiple, requeue=requeue
        )
