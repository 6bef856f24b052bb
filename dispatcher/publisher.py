"""Publishing claimed outbox rows to RabbitMQ, with every confirm outstanding at once.

The channel has publisher confirms and ``on_return_raises=True``, and every publish is
``mandatory``: an unroutable message is a failure, not a silent success (aio-pika's
default would drop it and still report an ack).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import aio_pika
import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from pamqp.commands import Basic

from outbox.broker import (
    APP_ID,
    CHUNK_MESSAGE_TYPE,
    CONTENT_TYPE,
    MESSAGE_TYPE,
    SESSION_SETUP_SECONDS,
    BrokerUnavailable,
    Topology,
    broker_urls,
    chunk_message_id,
    establish_topology,
    message_id,
)
from outbox.broker import connect as connect_to_broker
from outbox.store import ClaimedRow

logger = logging.getLogger(__name__)

PERSISTENT = int(aio_pika.DeliveryMode.PERSISTENT)

# Failures that mean the connection or channel is gone: publish nothing more on it.
_CONNECTION_ERRORS = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
)


@dataclass
class PublishOutcome:
    published: list[ClaimedRow] = field(default_factory=list)
    failed: list[tuple[ClaimedRow, str, str]] = field(default_factory=list)
    """(row, reason label, error text without payload)."""
    connection_lost: bool = False


@dataclass(frozen=True)
class Encoded:
    body: bytes
    properties: Basic.Properties


# One encoder for every body: json.dumps with non-default separators builds a new
# JSONEncoder on each call, a measurable share of encode's time per message.
_BODY_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encode(row: ClaimedRow) -> Encoded:
    """The message for one outbox row: a thin JSON body and its AMQP properties.

    Built straight as the wire frame's properties (not an ``aio_pika.Message``), since
    this runs once per message on the hot path; every field comes from database columns
    the schema already checks. A test keeps the body identical to what
    ``OperationMessage`` parses.
    """
    operation_id = str(row.operation_id)  # the body's and correlation_id's, built once
    body = _BODY_ENCODER.encode(
        {
            "v": 1,
            "operation_id": operation_id,
            "outbox_id": row.id,
            "tool": row.tool_name,
            "tool_version": row.tool_version,
            "input_fingerprint": row.input_fingerprint,
        }
    )
    traceparent = row.traceparent
    return Encoded(
        body=body.encode(),
        properties=Basic.Properties(
            content_type=CONTENT_TYPE,
            delivery_mode=PERSISTENT,
            message_id=message_id(row.id),
            correlation_id=operation_id,
            message_type=MESSAGE_TYPE,
            app_id=APP_ID,
            headers={"traceparent": traceparent} if traceparent is not None else None,
        ),
    )


def encode_chunk(rows: Sequence[ClaimedRow]) -> Encoded:
    """One message for several outbox rows of the same routing key: the chunked envelope
    (``v`` 2, :class:`outbox.broker.OperationChunk`), each entry the single envelope's
    fields and its row's trace context."""
    entries = []
    for row in rows:
        entry: dict[str, object] = {
            "operation_id": str(row.operation_id),
            "outbox_id": row.id,
            "tool": row.tool_name,
            "tool_version": row.tool_version,
            "input_fingerprint": row.input_fingerprint,
        }
        if row.traceparent is not None:
            entry["traceparent"] = row.traceparent
        entries.append(entry)
    return Encoded(
        body=_BODY_ENCODER.encode({"v": 2, "operations": entries}).encode(),
        properties=Basic.Properties(
            content_type=CONTENT_TYPE,
            delivery_mode=PERSISTENT,
            message_id=chunk_message_id([row.id for row in rows]),
            message_type=CHUNK_MESSAGE_TYPE,
            app_id=APP_ID,
        ),
    )


MESSAGES_PER_BATCH = 4
"""A claimed batch is spread over at least this many messages (when it has as many rows),
so that several consumers share a small backlog instead of one taking it whole."""


def chunk_size(batch: int, most: int) -> int:
    """How many rows each message of a ``batch`` of claimed rows carries: one when the
    batch is small (the outbox keeps up, each decision goes out as it comes), up to
    ``most`` as a backlog forms, where a chunk saves a message, a confirm and an ack per
    operation."""
    return max(1, min(most, math.ceil(batch / MESSAGES_PER_BATCH)))


def chunks(rows: Sequence[ClaimedRow], size: int) -> list[list[ClaimedRow]]:
    """The messages a batch becomes: runs of up to ``size`` rows in claim order, a new one
    wherever the routing key changes (a chunk is routed as one message, so a binding
    that sends one tool elsewhere still gets only that tool's operations)."""
    found: list[list[ClaimedRow]] = []
    for row in rows:
        last = found[-1] if found else None
        if last is not None and len(last) < size and last[0].routing_key == row.routing_key:
            last.append(row)
        else:
            found.append([row])
    return found


# Every reason label classify() and publish() give: the dispatcher exports each at 0 from
# its start, so the first failure of each is seen by rate().
PUBLISH_FAILURE_REASONS = (
    "unroutable",
    "nacked",
    "exchange_missing",
    "confirm_timeout",
    "connection_lost",
    "unexpected",
)


def classify(error: BaseException) -> tuple[str, str]:
    """(reason label, error text) for a failed publish. The text names the broker's
    reply, never the message."""
    if isinstance(error, aiormq.exceptions.PublishError):
        frame = error.frame
        reply = getattr(frame, "reply_text", "") or "returned"
        return "unroutable", (
            f"unroutable: broker returned the message ({reply}); no queue is bound for its "
            "routing key: run `outbox migrate --broker` with this deployment's OUTBOX_QUEUE "
            "and OUTBOX_TOOL_QUEUES"
        )
    if isinstance(error, aiormq.exceptions.DeliveryError):
        return "nacked", f"nacked: broker refused the message ({type(error.frame).__name__})"
    if isinstance(error, aiormq.exceptions.ChannelNotFoundEntity):
        return "exchange_missing", "exchange_missing: the exchange does not exist"
    if isinstance(error, TimeoutError | asyncio.CancelledError):
        return "confirm_timeout", "confirm_timeout: no confirm before the publish timeout"
    if isinstance(error, (*_CONNECTION_ERRORS, aiormq.exceptions.ChannelClosed)):
        return "connection_lost", f"connection_lost: {type(error).__name__}"
    return "unexpected", f"unexpected: {type(error).__name__}"


class Publisher:
    """One connection and one confirm channel to RabbitMQ."""

    def __init__(
        self,
        amqp_url: str | Sequence[str],
        heartbeat: int,
        topology: Topology,
        connection_name: str,
        *,
        declare_topology: bool = False,
        operations_per_message: int = 1,
    ) -> None:
        # One URL or a cluster's several (OUTBOX_AMQP_URL's comma-separated form).
        self._urls = broker_urls(amqp_url, heartbeat)
        self._connection_name = connection_name
        self._topology = topology
        self._declare_topology = declare_topology
        self._operations_per_message = operations_per_message
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._depth_channel: AbstractChannel | None = None

    async def connect(self) -> None:
        try:
            await self._open()
        except BaseException:
            await self.close()  # a half-opened session must not linger beside the next
            raise

    async def _open(self) -> None:
        # The name shows in the management UI and `rabbitmqctl list_connections`. The
        # connect has a deadline per address, so it stays outside the setup deadline:
        # with several addresses it may take several of those.
        self._connection = await connect_to_broker(
            self._urls, connection_name=self._connection_name
        )
        async with asyncio.timeout(SESSION_SETUP_SECONDS):
            self._channel = await self._connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            declared = await establish_topology(
                self._channel, self._topology, declare=self._declare_topology
            )
            self._exchange = declared.exchange

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._depth_channel = self._exchange = None
        if connection is not None and not connection.is_closed:
            try:
                await asyncio.wait_for(connection.close(), timeout=5)
            except (TimeoutError, *_CONNECTION_ERRORS, aiormq.exceptions.AMQPError):
                logger.debug("broker connection did not close cleanly")

    async def queue_depths(self) -> dict[str, float]:
        """Messages ready in the work queue, the dead-letter queue and each tool queue
        (by :meth:`Topology.depth_labels`), from passive declares on a channel of their own:
        a queue deleted meanwhile closes that channel, never the one that publishes. NaN
        for a queue the broker does not have."""
        connection = self._connection
        if connection is None or connection.is_closed:
            # aio-pika opens no channel on a closed connection (a RuntimeError): this is
            # the lost session the next publish would find too.
            raise BrokerUnavailable("the broker connection is closed")
        depths: dict[str, float] = {}
        async with asyncio.timeout(SESSION_SETUP_SECONDS):
            for queue, name in self._topology.depth_labels():
                if self._depth_channel is None or self._depth_channel.is_closed:
                    self._depth_channel = await connection.channel(publisher_confirms=False)
                try:
                    declared = await self._depth_channel.declare_queue(name, passive=True)
                except aiormq.exceptions.ChannelNotFoundEntity:
                    depths[queue] = math.nan
                    self._depth_channel = None
                    continue
                depths[queue] = float(declared.declaration_result.message_count or 0)
        return depths

    async def _underlay(self) -> aiormq.Channel:
        assert self._channel is not None
        channel = await self._channel.get_underlay_channel()
        # The concrete channel: its basic_publish takes ``wait`` (publish below), which
        # the abstract one does not declare.
        assert isinstance(channel, aiormq.Channel)
        return channel

    @property
    def usable(self) -> bool:
        return (
            self._exchange is not None
            and self._channel is not None
            and not self._channel.is_closed
            and self._connection is not None
            and not self._connection.is_closed
        )

    async def publish(self, rows: list[ClaimedRow], confirm_within: float) -> PublishOutcome:
        """Publish every row (one message each, or chunks of them) with every confirm
        outstanding at once; wait for all of them (or the timeout) and say which rows the
        broker confirmed. A chunk's rows share its confirm, and its failure."""
        outcome = PublishOutcome()
        if not self.usable:
            outcome.connection_lost = True
            outcome.failed = [
                (row, "connection_lost", "connection_lost: no broker channel") for row in rows
            ]
            return outcome
        channel = await self._underlay()
        groups = chunks(rows, chunk_size(len(rows), self._operations_per_message))
        tasks = []
        for group in groups:
            message = encode(group[0]) if len(group) == 1 else encode_chunk(group)
            tasks.append(
                asyncio.ensure_future(
                    channel.basic_publish(
                        message.body,
                        exchange=self._topology.exchange,
                        routing_key=group[0].routing_key,
                        properties=message.properties,
                        mandatory=True,
                        # Not waiting for each frame's socket drain: with it, every
                        # publish holds the channel's lock until the writer task has
                        # written and drained its frame, several loop iterations per
                        # message. The confirm is still awaited and a lost connection
                        # still fails it; unflushed bytes are bounded by the batch.
                        wait=False,
                    )
                )
            )
        _, pending = await asyncio.wait(tasks, timeout=confirm_within)
        for task in pending:
            task.cancel()
        for group, task in zip(groups, tasks, strict=True):
            error: BaseException | None
            if task in pending:
                error = TimeoutError()
            elif task.cancelled():
                # aiormq cancels the confirms outstanding on a connection it closes;
                # task.exception() would raise that cancellation into the dispatcher.
                error = ConnectionError("the broker connection closed before the confirm")
            else:
                error = task.exception()
            if error is None:
                outcome.published.extend(group)
                continue
            reason, text = classify(error)
            outcome.failed.extend((row, reason, text) for row in group)
            if reason in ("connection_lost", "exchange_missing", "confirm_timeout"):
                outcome.connection_lost = True
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return outcome
