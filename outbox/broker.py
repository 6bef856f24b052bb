"""What travels through RabbitMQ, and the topology ``outbox migrate --broker`` declares
and both daemons require.

Messages are thin: ids, the tool and the input fingerprint. The broker never sees
tool inputs; the consumer loads the operation from Postgres and trusts only that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit
from uuid import UUID

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, AbstractQueue
from pamqp.common import FieldTable
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from outbox.errors import ConfigurationError, ServiceUnavailable, TopologyMissing
from outbox.logs import log_fields
from outbox.settings import (
    MAX_MESSAGE_OPERATIONS,
    Settings,
    redact_amqp_urls,
    split_amqp_urls,
)
from outbox.tool_queues import binding_key

T = TypeVar("T")
logger = logging.getLogger(__name__)

CONTENT_TYPE = "application/json"
MESSAGE_TYPE = "outbox.operation.v1"
APP_ID = "effect-outbox"
CONNECT_TIMEOUT_SECONDS = 10
# Opening a session (connection, channel, topology, consumer) has no deadline of its own
# in aio-pika: a broker half-way through starting can accept the connection and never
# answer a quorum queue's declare, and a daemon waiting on it consumes nothing, forever.
SESSION_SETUP_SECONDS = 30


class BrokerUnavailable(Exception):
    """The broker connection or channel failed; reconnect before the next batch."""


class OperationMessage(BaseModel):
    """The body of every message: enough to find the operation, nothing of its input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1
    operation_id: UUID
    outbox_id: int = Field(ge=1)
    tool: str = Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")
    tool_version: int = Field(ge=1)
    input_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")


# A single envelope is ~250 bytes, an entry of a chunk at most ~320, so
# MAX_MESSAGE_OPERATIONS entries fit in MAX_CHUNK_BODY_BYTES. The consumer dead-letters
# anything larger unparsed, so a hostile body costs no parse.
MAX_ENVELOPE_BYTES = 4096
MAX_CHUNK_BODY_BYTES = 32_768
CHUNK_MESSAGE_TYPE = "outbox.operations.v2"
# How the dispatcher starts a chunk's body: a consumer bounds a body by the larger limit
# only when it starts so.
CHUNK_BODY_START = b'{"v":2,'


class ChunkEntry(OperationMessage):
    """One operation of a chunk: the single envelope's fields and the decision's W3C trace
    context, which a single message carries as its ``traceparent`` header. Each entry is
    parsed here and checked against its row like a message of its own."""

    # Checked again where it is used (outbox.tracing.valid_traceparent); bounded here.
    traceparent: str | None = Field(default=None, max_length=64)


class OperationChunk(BaseModel):
    """The body of a message that carries several operations (``v`` 2): one broker message
    and one acknowledgement for up to :data:`MAX_MESSAGE_OPERATIONS` of them, all with the
    same routing key. Dedupe and every check stay per operation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[2]
    operations: tuple[ChunkEntry, ...] = Field(min_length=1, max_length=MAX_MESSAGE_OPERATIONS)


def oversized(body: bytes) -> bool:
    """Whether ``body`` is larger than any envelope may be: a chunk's limit for a body
    that starts as the dispatcher starts a chunk, a single envelope's for any other.
    Checked before parsing, so a hostile body costs no parse."""
    limit = MAX_CHUNK_BODY_BYTES if body.startswith(CHUNK_BODY_START) else MAX_ENVELOPE_BYTES
    return len(body) > limit


_BODY = TypeAdapter[OperationMessage | OperationChunk](OperationMessage | OperationChunk)


def parse_body(body: bytes) -> OperationMessage | OperationChunk:
    """The envelope of a message body, single or chunk; raises pydantic's
    ``ValidationError`` for anything else."""
    return _BODY.validate_json(body)


def message_id(outbox_id: int) -> str:
    """Stable per outbox row: a re-publish of the same row carries the same id."""
    return f"outbox-{outbox_id}"


def chunk_message_id(outbox_ids: Sequence[int]) -> str:
    """A chunk's first row and how many it holds. Unlike a single row's id it may differ
    on a re-publish, whose batch can group the rows otherwise."""
    return f"outbox-{outbox_ids[0]}-n{len(outbox_ids)}"


def routing_key(tool: str, tool_version: int) -> str:
    """The routing key of an operation's messages, as ``outbox_record_decision`` writes
    it on the outbox row."""
    return f"{tool}.v{tool_version}"


def single_message(entry: ChunkEntry) -> aio_pika.Message:
    """The message a chunk's entry is on its own, as the dispatcher would have published
    its row alone: the single envelope, the row's message id and the entry's trace
    context as the ``traceparent`` header. A consumer sends an entry that cannot be
    settled with its chunk round again this way (see ``consumer.chunks``)."""
    envelope = OperationMessage.model_validate(entry.model_dump(exclude={"traceparent"}))
    return aio_pika.Message(
        envelope.model_dump_json().encode(),
        content_type=CONTENT_TYPE,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=message_id(entry.outbox_id),
        correlation_id=str(entry.operation_id),
        type=MESSAGE_TYPE,
        app_id=APP_ID,
        headers={"traceparent": entry.traceparent} if entry.traceparent is not None else None,
    )


@dataclass(frozen=True)
class Topology:
    exchange: str
    queue: str
    dead_letter_exchange: str
    dead_letter_queue: str
    delivery_limit: int
    tool_queues: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``OUTBOX_TOOL_QUEUES``: each group's queue and its tools; empty, every tool is on
    ``queue`` and the topology is the one exchange and queue it always was."""
    consume_queue: str | None = None
    """The queue a consumer reads (``OUTBOX_CONSUME_QUEUE``); None is ``queue``."""

    @classmethod
    def from_settings(cls, settings: Settings) -> Topology:
        return cls(
            exchange=settings.exchange,
            queue=settings.queue,
            dead_letter_exchange=settings.dead_letter_exchange,
            dead_letter_queue=settings.dead_letter_queue,
            delivery_limit=settings.delivery_limit,
            tool_queues=tuple(settings.tool_queue_groups.items()),
            consume_queue=settings.consume_queue,
        )

    @property
    def queue_arguments(self) -> dict[str, Any]:
        # Quorum queues count deliveries; without an explicit limit (RabbitMQ 3.10 has no
        # default) a poison message would be redelivered forever.
        return {
            "x-queue-type": "quorum",
            "x-delivery-limit": self.delivery_limit,
            "x-dead-letter-exchange": self.dead_letter_exchange,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }

    @property
    def by_tool_exchange(self) -> str:
        """With groups: where the exchange sends every message (one ``#`` binding), and
        where each group's queue is bound by its tools' keys."""
        return f"{self.exchange}.by-tool"

    @property
    def other_tools_exchange(self) -> str:
        """With groups: the by-tool exchange's alternate exchange, a fanout to ``queue``,
        which takes every message no group's binding matched."""
        return f"{self.exchange}.other-tools"

    @property
    def consumed(self) -> str:
        return self.consume_queue or self.queue

    def depth_labels(self) -> list[tuple[str, str]]:
        """(gauge label, queue name) for every queue the dispatcher reports the depth of:
        the default and dead-letter queues by their roles (:data:`outbox.metrics.QUEUES`),
        each group's queue by its name (operator configuration, never user input)."""
        return [
            ("operations", self.queue),
            ("dead_letter", self.dead_letter_queue),
            *((name, name) for name, _ in self.tool_queues),
        ]


@dataclass(frozen=True)
class DeclaredTopology:
    exchange: AbstractExchange
    queue: AbstractQueue
    """The queue a consumer of this topology reads (:attr:`Topology.consumed`)."""
    dead_letter_queue: AbstractQueue


async def declare_topology(
    channel: AbstractChannel, topology: Topology, *, reroute: bool = False
) -> DeclaredTopology:
    """Declare exchanges, queues and bindings; idempotent while the arguments match.

    ``reroute`` (``outbox migrate --broker``) also removes the routes the settings no
    longer name: a tool moved out of a group, groups given up. A daemon's own declare
    only adds, so a reconnect never disturbs routing.

    A queue that exists with other arguments makes the broker close the channel with
    PRECONDITION_FAILED: a :class:`ConfigurationError` here, since no retry cures it.
    """
    try:
        return await _declare(channel, topology, reroute=reroute)
    except aiormq.exceptions.ChannelPreconditionFailed as mismatch:
        raise ConfigurationError(
            f"the broker refused the topology: {mismatch}. A queue or exchange already "
            "exists with other arguments; delete it or choose other names (OUTBOX_QUEUE, "
            "OUTBOX_EXCHANGE, OUTBOX_TOOL_QUEUES, ...)"
        ) from None


async def _declare(
    channel: AbstractChannel, topology: Topology, *, reroute: bool
) -> DeclaredTopology:
    if (
        not topology.tool_queues
        and not reroute
        and await _exchange_exists(channel, topology.by_tool_exchange)
    ):
        # Its `#` binding below would send every grouped tool to the default queue as
        # well as to its group's: each message delivered twice, to two sets of consumers.
        raise ConfigurationError(
            f"the broker routes by tool (exchange {topology.by_tool_exchange!r} exists: "
            "`outbox migrate --broker` ran with OUTBOX_TOOL_QUEUES), and this daemon has "
            "no groups; give it the same OUTBOX_TOOL_QUEUES, or run `outbox migrate "
            "--broker` without them to give the groups up"
        )
    exchange = await channel.declare_exchange(
        topology.exchange, aio_pika.ExchangeType.TOPIC, durable=True
    )
    dead_letter_exchange = await channel.declare_exchange(
        topology.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
    )
    dead_letter_queue = await channel.declare_queue(
        topology.dead_letter_queue, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await dead_letter_queue.bind(dead_letter_exchange, routing_key="#")
    queue = await channel.declare_queue(
        topology.queue, durable=True, arguments=topology.queue_arguments
    )
    if topology.tool_queues:
        consumed = await _route_by_tool(channel, topology, exchange, queue, reroute=reroute)
    else:
        if reroute:
            # Groups given up: their exchanges go first (a message then finds no route
            # for a moment and is returned, kept pending and published again), so that
            # no message ever reaches a group's queue and the default one both.
            await channel.exchange_delete(topology.by_tool_exchange)
        await queue.bind(exchange, routing_key="#")
        if reroute:
            await channel.exchange_delete(topology.other_tools_exchange)
        consumed = queue
    return DeclaredTopology(exchange=exchange, queue=consumed, dead_letter_queue=dead_letter_queue)


async def _route_by_tool(
    channel: AbstractChannel,
    topology: Topology,
    exchange: AbstractExchange,
    queue: AbstractQueue,
    *,
    reroute: bool,
) -> AbstractQueue:
    """Each group's tools to its queue, every other tool to ``queue``, none to both.

    A topic binding cannot say "every key but these", and the exchange cannot take an
    alternate exchange without being declared again with other arguments (which RabbitMQ
    refuses for an exchange that exists). So the exchange sends everything, by one ``#``
    binding, to an internal by-tool exchange declared with an alternate exchange: a
    message a group's binding matches goes to that group's queue only, and one no binding
    matches goes to the alternate, a fanout to ``queue``. Nothing is left unroutable.
    """
    other_tools = await channel.declare_exchange(
        topology.other_tools_exchange, aio_pika.ExchangeType.FANOUT, durable=True, internal=True
    )
    await queue.bind(other_tools, routing_key="")
    group_queues = {
        name: await channel.declare_queue(name, durable=True, arguments=topology.queue_arguments)
        for name, _ in topology.tool_queues
    }
    # Before the by-tool route exists, or a grouped tool would reach both queues.
    await queue.unbind(exchange, routing_key="#")
    if reroute:
        # Deleting the by-tool exchange takes every binding of a tool moved or dropped
        # along with it: AMQP has no way to list bindings, and a stale one would send a
        # tool to its old queue as well as its new. Until it is bound again below, a
        # message finds no route, is returned to its publisher and stays pending.
        await channel.exchange_delete(topology.by_tool_exchange)
    by_tool = await channel.declare_exchange(
        topology.by_tool_exchange,
        aio_pika.ExchangeType.TOPIC,
        durable=True,
        internal=True,
        arguments={"alternate-exchange": topology.other_tools_exchange},
    )
    for name, tools in topology.tool_queues:
        for tool in tools:
            await group_queues[name].bind(by_tool, routing_key=binding_key(tool))
    await by_tool.bind(exchange, routing_key="#")
    if topology.consume_queue is not None and topology.consume_queue in group_queues:
        return group_queues[topology.consume_queue]
    return queue


async def require_topology(channel: AbstractChannel, topology: Topology) -> DeclaredTopology:
    """The exchanges and queues ``outbox migrate --broker`` declared, checked passively.

    Declaring them here would turn a mistyped name into a new queue that nobody
    consumes (or that no dispatcher publishes to) while every daemon looks healthy.
    Only existence is checked: a passive declare cannot compare arguments, nor see
    bindings.
    """
    exchange = await _existing(
        channel.get_exchange(topology.exchange, ensure=True),
        f"exchange {topology.exchange!r} (OUTBOX_EXCHANGE)",
    )
    queue = await _existing(
        channel.get_queue(topology.queue, ensure=True), f"queue {topology.queue!r} (OUTBOX_QUEUE)"
    )
    await _existing(
        channel.get_exchange(topology.dead_letter_exchange, ensure=True),
        f"exchange {topology.dead_letter_exchange!r} (OUTBOX_DEAD_LETTER_EXCHANGE)",
    )
    dead_letter_queue = await _existing(
        channel.get_queue(topology.dead_letter_queue, ensure=True),
        f"queue {topology.dead_letter_queue!r} (OUTBOX_DEAD_LETTER_QUEUE)",
    )
    consumed = queue
    if topology.tool_queues:
        await _existing(
            channel.get_exchange(topology.by_tool_exchange, ensure=True),
            f"exchange {topology.by_tool_exchange!r} (routing by OUTBOX_TOOL_QUEUES)",
        )
        for name, _ in topology.tool_queues:
            found = await _existing(
                channel.get_queue(name, ensure=True), f"queue {name!r} (OUTBOX_TOOL_QUEUES)"
            )
            if name == topology.consume_queue:
                consumed = found
    return DeclaredTopology(exchange=exchange, queue=consumed, dead_letter_queue=dead_letter_queue)


async def establish_topology(
    channel: AbstractChannel, topology: Topology, *, declare: bool
) -> DeclaredTopology:
    """What a daemon does at the start of each broker session (``OUTBOX_DECLARE_TOPOLOGY``)."""
    if declare:
        return await declare_topology(channel, topology)
    return await require_topology(channel, topology)


async def delete_topology(amqp_url: str, topology: Topology) -> None:
    """Delete the queues, then the exchanges, of names made for one run (the demo, the
    tests, the benchmarks); one that is missing already is fine. With the messages in
    them: never point this at a deployment's names."""
    connection = await connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        for kind, name in (
            ("queue", topology.queue),
            *(("queue", group) for group, _ in topology.tool_queues),
            ("queue", topology.dead_letter_queue),
            ("exchange", topology.exchange),
            ("exchange", topology.by_tool_exchange),
            ("exchange", topology.other_tools_exchange),
            ("exchange", topology.dead_letter_exchange),
        ):
            try:
                if kind == "queue":
                    await channel.queue_delete(name)
                else:
                    await channel.exchange_delete(name)
            except aiormq.exceptions.ChannelNotFoundEntity:
                # A broker that answers NOT_FOUND (RabbitMQ does not, others may) closes
                # the channel with it.
                channel = await connection.channel()


async def _exchange_exists(channel: AbstractChannel, name: str) -> bool:
    """Whether the broker has exchange ``name``, asked on a channel of its own: a passive
    declare of one the broker lacks closes the channel it was asked on, and the daemon's
    own channel closing reads to it as a lost session."""
    connection = (await channel.get_underlay_channel()).connection
    side = await connection.channel()
    try:
        await side.exchange_declare(exchange=name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        if not side.is_closed:
            await side.close()
    return True


async def _existing(declare: Awaitable[T], what: str) -> T:
    try:
        return await declare
    except aiormq.exceptions.ChannelNotFoundEntity:
        raise TopologyMissing(
            f"the broker has no {what}: run `outbox migrate --broker` with the same "
            "OUTBOX_EXCHANGE, OUTBOX_QUEUE, OUTBOX_TOOL_QUEUES and dead-letter settings as "
            "this daemon, check "
            "those settings for a typo, or pass --declare-topology (OUTBOX_DECLARE_TOPOLOGY="
            "true) to let the daemon declare them"
        ) from None


def amqp_url_with_heartbeat(url: str, heartbeat: int) -> str:
    """The URL with a heartbeat so a silent broker is noticed, unless it names its own."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.setdefault("heartbeat", str(heartbeat))
    return urlunsplit(parts._replace(query=urlencode(query)))


def broker_urls(amqp_url: str | Sequence[str], heartbeat: int) -> list[str]:
    """Each address of ``OUTBOX_AMQP_URL`` (or of a list) with the heartbeat added."""
    urls = split_amqp_urls(amqp_url) if isinstance(amqp_url, str) else list(amqp_url)
    return [amqp_url_with_heartbeat(url, heartbeat) for url in urls]


# Per process, for each list of addresses: the position of the one that failed last,
# by refusing a connect or by dropping a connection it had opened. The next connect
# starts after it, so a node known to be down is tried last instead of first: a host
# that is gone (not refusing, silent) costs a whole connect timeout per attempt. Kept
# per process rather than per daemon so one-shot callers learn it too; it is only a
# hint of where to start, and every address is still tried.
_last_failed: dict[tuple[str, ...], int] = {}


def attempt_order(count: int, last_failed: int | None) -> list[int]:
    """The positions of ``count`` addresses in the order a connect tries them: the
    operator's order, starting after the one that failed last. Not shuffled: the
    operator may list the nearest node first, and a quorum queue's leader does the
    work whichever node a client is connected to, so spreading clients buys little."""
    start = 0 if last_failed is None else (last_failed + 1) % count
    return [(start + offset) % count for offset in range(count)]


def forget_failed_addresses() -> None:
    """Start every list of addresses at its first again (for tests)."""
    _last_failed.clear()


async def connect(
    amqp_url: str | Sequence[str], *, connection_name: str | None = None
) -> AbstractConnection:
    """A connection to the first address that opens one, each tried with its own
    timeout, starting after the address that failed last. ``amqp_url`` is one URL,
    several separated by commas (``OUTBOX_AMQP_URL``'s form) or a list. If none opens,
    the last address's error is raised: the daemons' session loop treats it as
    transient and tries again after a backoff.

    Not ``aio_pika.connect_robust``: each daemon runs its own sessions (topology,
    consumer, confirms) and must know when one ends."""
    urls = split_amqp_urls(amqp_url) if isinstance(amqp_url, str) else list(amqp_url)
    if not urls:
        raise ValueError("no broker address to connect to")
    key = tuple(urls)
    several = len(urls) > 1
    failure: BaseException | None = None
    for position in attempt_order(len(urls), _last_failed.get(key)):
        try:
            connection = await _connect_one(urls[position], connection_name)
        except (OSError, aiormq.exceptions.AMQPConnectionError) as error:
            _last_failed[key] = position
            failure = error
            if several:
                log_fields(
                    logger,
                    logging.WARNING,
                    "broker.address_failed",
                    "could not connect to this broker address; trying the next",
                    broker=_host_port(urls[position]),
                    error=type(error).__name__,
                )
            continue
        if several:
            connection.close_callbacks.add(_remember_loss(key, position, connection))
            # Which node a process is on, for whoever follows a failover in the logs.
            log_fields(
                logger,
                logging.INFO,
                "broker.connected",
                "connected to the broker",
                broker=_host_port(urls[position]),
            )
        return connection
    assert failure is not None
    raise failure


def _remember_loss(
    key: tuple[str, ...], position: int, connection: AbstractConnection
) -> Callable[..., None]:
    def closed(*_: object) -> None:
        # A close we asked for says nothing about the node; one we did not (the node
        # stopped, the link broke) moves the next connect on to the next address.
        if not connection.close_called:
            _last_failed[key] = position

    return closed


def _host_port(url: str) -> str:
    """Where a URL points, without its credentials or virtual host: a log field."""
    parts = urlsplit(url)
    default = 5671 if parts.scheme == "amqps" else 5672
    return f"{parts.hostname or 'localhost'}:{parts.port or default}"


async def _connect_one(url: str, connection_name: str | None) -> AbstractConnection:
    """``aio_pika.connect``, with a handshake the peer cut short reported as the
    connection error it is. aiormq raises StopAsyncIteration when the socket reaches end
    of file before the first frame (a broker starting or stopping, a proxy whose upstream
    refused); a daemon's reconnect loop would not recognise that and die."""
    client_properties: FieldTable | None = (
        {"connection_name": connection_name} if connection_name else None
    )
    try:
        # The deadline covers the whole handshake (aio_pika's own timeout does not
        # cover its final wait for the connection to be ready): with several
        # addresses, each gets this long and a session's setup deadline starts after.
        async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
            return await aio_pika.connect(
                url, timeout=CONNECT_TIMEOUT_SECONDS, client_properties=client_properties
            )
    except StopAsyncIteration as cut:
        raise aiormq.exceptions.AMQPConnectionError(
            "the broker closed the connection during the handshake"
        ) from cut


class _Silenced(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _silenced(*names: str) -> Iterator[None]:
    """No records from these loggers meanwhile: a command says what failed in its one
    line, and aiormq's own "error when creating transport" would be a second."""
    silenced = _Silenced()
    loggers = [logging.getLogger(name) for name in names]
    for each in loggers:
        each.addFilter(silenced)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(silenced)


async def connect_for_command(settings: Settings) -> AbstractConnection:
    """A broker connection for a one-shot command. An unreachable broker is a service
    that is down, not a setting that is wrong (``outbox`` exits 1, as for any other
    failure): one error naming every address, passwords redacted, and no log line
    besides."""
    try:
        with _silenced("aiormq.connection", __name__):
            return await connect(broker_urls(settings.amqp_urls, settings.amqp_heartbeat))
    except (OSError, aiormq.exceptions.AMQPConnectionError) as failure:
        raise ServiceUnavailable(
            f"cannot connect to {redact_amqp_urls(settings.amqp_url.get_secret_value())}: "
            f"{type(failure).__name__}. Is RabbitMQ running, and is OUTBOX_AMQP_URL right?"
        ) from None
