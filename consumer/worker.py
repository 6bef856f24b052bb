"""The consumer: deliveries to effects, at most once per proven-absent outcome.

Per delivery: parse the thin envelope -> load the operation (the database is the only
thing trusted) -> claim ``prepared -> in_flight`` with a lease and a fencing token,
committed before any external call -> check the approval -> execute with the operation
id as idempotency key and a deadline -> record the outcome under the fencing token ->
ack. A delivery whose claim fails is a duplicate: acked, counted, never executed.

This module keeps the delivery loop: broker sessions, a task per delivery, acks,
dead letters and nacks. A delivery whose claim or record meets a database that is away
or too slow stays unacknowledged in hand and is tried again with backoff: a nack would
count toward the queue's delivery limit and dead-letter it within seconds of an outage,
for a fault of ours. Meanwhile the prefetch narrows (:mod:`outbox.pacing`). The claim
and its checks are :mod:`consumer.claims`, the call and its record
:mod:`consumer.effects`; what an outcome leads to is decided in :mod:`consumer.policy`;
unknown outcomes and expired leases are the :class:`~consumer.reconciler.Reconciler`'s,
which runs beside the deliveries in the same process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from uuid import UUID

import aiormq.exceptions
import pydantic
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    ConsumerTag,
)
from aiormq.abc import DeliveredMessage

from consumer.acks import Settlement, Settlements
from consumer.chunks import Chunks, Handled, InHand, Resend, safe_message_id
from consumer.claims import Claimed, Claims, Skip
from consumer.database import APPLICATION_NAME, Database
from consumer.deliveries import Delivery, Received
from consumer.effects import Effects
from consumer.gauges import ExecutionGauges
from consumer.policy import Attempt
from consumer.providers import Providers
from consumer.reconciler import Reconciler
from consumer.telemetry import log, logger, prime_metrics
from outbox import tracing
from outbox.backoff import Backoff
from outbox.broker import (
    SESSION_SETUP_SECONDS,
    ChunkEntry,
    DeclaredTopology,
    OperationChunk,
    OperationMessage,
    Topology,
    broker_urls,
    establish_topology,
    oversized,
    parse_body,
    routing_key,
    single_message,
)
from outbox.broker import connect as connect_to_broker
from outbox.contracts import Registry
from outbox.daemon import Daemon, is_transient_database_error
from outbox.errors import (
    ConfigurationError,
    SchemaMissing,
)
from outbox.metrics import ConsumerMetrics
from outbox.settings import Settings, redact_url
from outbox.states import OperationState

DEFAULT_METRICS_PORT = 9465
S = OperationState
T = TypeVar("T")

# A delivery the database cannot take yet is tried again after 0.5 s, doubling to 5 s:
# a database back from an outage is in use within seconds, and a held burst costs it a
# connect attempt per delivery per few seconds meanwhile.
HOLD_FIRST_RETRY_SECONDS = 0.5
HOLD_LONGEST_RETRY_SECONDS = 5.0
# Held longer than this, a delivery goes back to the queue after all: RabbitMQ closes
# a channel whose delivery stays unacknowledged past its consumer_timeout (30 min by
# default), which would return every delivery of the channel at once.
HOLD_AT_MOST_SECONDS = 600.0


class Consumer(Daemon):
    """Takes deliveries from the queue to effects, with the reconciler running beside."""

    name = "consumer"
    default_metrics_port = DEFAULT_METRICS_PORT

    def __init__(
        self, settings: Settings, registry: Registry, metrics: ConsumerMetrics | None = None
    ) -> None:
        if not len(registry):
            raise ConfigurationError(
                "a consumer needs at least one registered tool: the --tools modules hold none"
            )
        super().__init__(settings, logger)
        self.registry = registry
        self.metrics = metrics or ConsumerMetrics.create()
        prime_metrics(self.metrics, registry)
        self.database = Database(
            settings,
            self.metrics,
            self.server_tracker(self.metrics.database_failovers),
            on_lock_wait=self.lock_waits(self.metrics.lock_waits),
        )
        # One copy of the providers' breakers for the deliveries and the reconciler.
        self.providers = Providers(
            settings, registry, self.metrics, self.database, worker_id=self.worker_id
        )
        self.reconciler = Reconciler(
            settings,
            registry,
            self.metrics,
            self.database,
            worker_id=self.worker_id,
            providers=self.providers,
        )
        self.gauges = ExecutionGauges(self.metrics, self.database, providers=self.providers.tools)
        self._topology = Topology.from_settings(settings)
        self._broker_ready = False
        self.metrics.broker_connected.set(0)
        # Whether the session being ended had been established: only the loss of one is
        # a reconnect (a connect that fails is not), as the dispatcher counts them.
        self._session_established = False
        self._handlers: set[asyncio.Task[Any]] = set()
        # Group commit: the deliveries in hand share their claim transaction and their
        # outcome transaction, instead of two transactions each.
        self.claims = Claims(
            settings,
            registry,
            self.metrics,
            self.database,
            worker_id=self.worker_id,
            providers=self.providers,
        )
        self.effects = Effects(settings, self.metrics, self.database, self.providers)
        self._chunks = Chunks(
            self,
            self.metrics,
            InHand(self.database.in_hand_limit),
        )

    def healthy(self) -> bool:
        return self._broker_ready and not self.stopping

    def stop(self) -> None:
        """Take no new deliveries and stop reconciling; the effects in hand finish."""
        super().stop()
        self.reconciler.stop()
        self.gauges.stop()
        self.providers.stop()

    async def close(self) -> None:
        await self.database.close()

    async def requeue_stale(self) -> list[UUID]:
        """One stale sweep of the reconciler's (see :meth:`Reconciler.requeue_stale`)."""
        return await self.reconciler.requeue_stale()

    async def run(self) -> None:
        """Consume and reconcile until :meth:`stop`; in-flight effects finish first."""
        try:
            async with self.serving(
                self.metrics.registry,
                tools=self.registry.describe(),
                queue=self._topology.consumed,
                database=redact_url(self.settings.libpq_url),
                **self.database.bounds.fields(),
            ):
                await self._require_schema()
                beside = [
                    asyncio.create_task(self.reconciler.run()),
                    asyncio.create_task(self.gauges.run()),
                    asyncio.create_task(self.providers.run()),
                ]
                try:
                    await self.keep_sessions(self._consume_session, self._session_lost)
                    # Stopped between sessions: what a lost session left in hand still
                    # finishes and records its outcome before the pool closes.
                    if self._handlers:
                        await asyncio.gather(*self._handlers, return_exceptions=True)
                finally:
                    for task in beside:
                        task.cancel()
                    for task in beside:
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
        finally:
            await self.close()

    async def _require_schema(self) -> None:
        """Refuse to run on a database without the outbox schema, as the dispatcher
        does: otherwise this process would answer /healthz and fail every delivery.
        A database that is away is waited for, as every connect is."""

        async def schema_present() -> bool:
            # A coroutine function, not a lambda returning a coroutine: tenacity calls a
            # plain callable without awaiting what it returns.
            return await asyncio.to_thread(self.database.schema_present)

        try:
            present = await self.connect_with_retry(schema_present, "database")
        except Exception:
            if self.stopping:
                return  # stopped while the database was away: nothing to refuse
            raise
        if not present:
            raise SchemaMissing()

    def _set_broker_ready(self, ready: bool) -> None:
        self._broker_ready = ready
        self.metrics.broker_connected.set(1 if ready else 0)

    def _session_lost(self, peer: str) -> None:
        self._set_broker_ready(False)
        if self._session_established:
            self.metrics.reconnects.inc()
        self._session_established = False

    async def _consume_session(self) -> None:
        # Each address of a cluster in turn, each with its own connect deadline (so
        # no setup deadline around it: several addresses may take several of those).
        connection = await connect_to_broker(
            broker_urls(self.settings.amqp_urls, self.settings.amqp_heartbeat),
            connection_name=f"{APPLICATION_NAME} {self.worker_id}",
        )
        closed = asyncio.Event()
        connection.close_callbacks.add(lambda *_: closed.set())
        async with connection:
            async with asyncio.timeout(SESSION_SETUP_SECONDS):
                declared, tag = await self._start_consuming(connection, closed)
            self._set_broker_ready(True)
            self._session_established = True
            self.log(logging.INFO, "session_ready", "session ready")
            stop = asyncio.ensure_future(self.wait_for_stop())
            lost = asyncio.ensure_future(closed.wait())
            pacing = asyncio.create_task(self._apply_prefetch(declared.queue.channel))
            try:
                await asyncio.wait([stop, lost], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                lost.cancel()
                pacing.cancel()
            self._set_broker_ready(False)
            if closed.is_set() and not self.stopping:
                raise aiormq.exceptions.AMQPConnectionError(
                    "the broker closed the connection or the channel, or cancelled the consumer"
                )
            # Graceful stop: take no new deliveries, let the effects in hand finish.
            with contextlib.suppress(aiormq.exceptions.AMQPError):
                await declared.queue.cancel(tag)
            if self._handlers:
                await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _start_consuming(
        self, connection: AbstractConnection, closed: asyncio.Event
    ) -> tuple[DeclaredTopology, ConsumerTag]:
        # Confirms and returns raised: an entry a chunk sends round alone (see
        # consumer.chunks) must be routed and taken before the chunk is acknowledged.
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        # A channel the broker closed, or a consumer it cancelled (a quorum queue's
        # leader moving after a restart), leaves the connection open and nothing
        # consuming: a session that ends that way is lost like a closed connection.
        channel.close_callbacks.add(lambda *_: closed.set())
        await channel.set_qos(prefetch_count=self.database.pacing.limit)
        declared = await establish_topology(
            channel, self._topology, declare=self.settings.declare_topology
        )
        underlay = await channel.get_underlay_channel()

        async def cancelled_by_broker(*_: object) -> None:
            closed.set()

        underlay.on_consumer_cancel_callbacks.add(cancelled_by_broker)
        settlements = Settlements()  # delivery tags are the channel's own
        exchange = declared.exchange
        publish_timeout = self.settings.publish_timeout

        async def resend(entry: ChunkEntry) -> None:
            await exchange.publish(
                single_message(entry),
                routing_key=routing_key(entry.tool, entry.tool_version),
                timeout=publish_timeout,
            )

        # Straight on aiormq, not through ``Queue.consume``: its wrapper builds an
        # ``IncomingMessage`` (see consumer.deliveries) and runs the callback in a task
        # of its own, a second task per message on top of the channel's, where this
        # consumer's handling needs only one that it owns (see ``_start_handling``).
        async def on_delivery(delivered: DeliveredMessage) -> None:
            self._start_handling(Delivery(delivered), settlements, resend)

        consuming = await underlay.basic_consume(
            queue=declared.queue.name, consumer_callback=on_delivery
        )
        if consuming.consumer_tag is None:  # pamqp types it optional; RabbitMQ always names it
            raise aiormq.exceptions.AMQPConnectionError("the broker named no consumer tag")
        return declared, ConsumerTag(consuming.consumer_tag)

    async def _apply_prefetch(self, channel: AbstractChannel) -> None:
        """Apply each new backpressure limit as the channel's prefetch (``basic.qos``):
        a narrowed consumer is sent fewer deliveries, not handed them and sent back."""
        applied = self.database.pacing.limit
        while True:
            await self.database.limit_changed.wait()
            self.database.limit_changed.clear()
            limit = self.database.pacing.limit
            if limit == applied:
                continue
            try:
                # Shielded: aiormq closes a channel whose RPC is cancelled, and this task is
                # cancelled when the session ends, while the deliveries in hand still
                # have their acks to send on that channel.
                await asyncio.shield(channel.set_qos(prefetch_count=limit))
            except Exception as error:
                # The session's to notice a lost channel; this one only stops pacing it.
                log(
                    logging.WARNING,
                    "consumer.prefetch_failed",
                    "could not apply a new prefetch",
                    error=type(error).__name__,
                )
                return
            applied = limit
            log(logging.INFO, "consumer.prefetch", "prefetch changed", prefetch=limit)

    def _start_handling(
        self, message: Received, settlements: Settlements, resend: Resend | None = None
    ) -> None:
        # aiormq runs the delivery callback as a task of the channel and cancels it when
        # the channel closes. The effect in hand must not be cut off with it: its
        # operation would sit in flight until its lease ran out and then be looked up
        # and called again. The handling runs in a task this consumer owns, so a lost
        # connection costs only the ack (the redelivery is a duplicate the claim
        # suppresses); the channel's task ends as soon as this one has started.
        handling = asyncio.create_task(self._deliver(message, settlements, resend))
        self._handlers.add(handling)
        handling.add_done_callback(self._handlers.discard)

    async def _deliver(
        self, message: Received, settlements: Settlements, resend: Resend | None
    ) -> None:
        try:
            await self.handle(message, settlements, resend)
        except (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError) as error:
            # The outcome is already recorded; the broker will redeliver the unacked
            # message and the claim will see it as a duplicate.
            log(
                logging.WARNING,
                "consumer.ack_failed",
                "ack failed; the redelivery will be a duplicate",
                error=type(error).__name__,
            )
        except Exception as error:
            # Anything unforeseen: leave the message to the broker (redelivered, and
            # dead-lettered past the delivery limit) rather than lose track of it.
            log(
                logging.ERROR,
                "consumer.delivery_failed",
                "delivery failed; left to the broker",
                error=type(error).__name__,
            )
            await self._sleep(1.0)  # no hot loop of redeliveries while it persists
            with contextlib.suppress(Exception):
                await settlements.settle(message, Settlement.REQUEUE)

    async def handle(
        self, message: Received, settlements: Settlements, resend: Resend | None = None
    ) -> str:
        """Handle one delivery and settle it; returns its result label (for metrics and
        tests), ``"chunk"`` for a message of several operations. ``resend`` publishes an
        entry of a chunk alone; without it such an entry returns the chunk whole."""
        if oversized(message.body):
            return await self.dead_letter(message, settlements, "oversized")
        try:
            envelope = parse_body(message.body)
        except pydantic.ValidationError:
            return await self.dead_letter(message, settlements, "malformed")
        if isinstance(envelope, OperationChunk):
            return await self._chunks.handle(message, settlements, envelope, resend)
        # Only a well-formed W3C traceparent may parent the span; any other header is ignored.
        headers = message.headers or {}
        handled = await self._operate(
            envelope, tracing.valid_traceparent(headers.get("traceparent"))
        )
        if handled.returned is not None:
            return await self._later(message, settlements, handled.returned)
        if handled.dead_letter_reason is not None:
            return await self.dead_letter(message, settlements, handled.dead_letter_reason)
        self.metrics.deliveries.labels(handled.result).inc()
        await settlements.settle(message, Settlement.ACK)
        return handled.result

    async def claim_entry(self, envelope: OperationMessage) -> Claimed | Handled:
        """One operation's claim: claimed, or what its message should get instead. Raises
        what is not the database being away."""
        try:
            claimed = await self._holding(lambda: self.claim(envelope))
        except Exception as error:
            if not is_transient_database_error(error):
                raise
            return Handled("retry_later", returned=error)
        if isinstance(claimed, Skip):
            return Handled(claimed.result, dead_letter_reason=claimed.dead_letter_reason)
        return claimed

    async def _operate(self, envelope: OperationMessage, traceparent: str | None) -> Handled:
        """One operation's claim, call and record; what its message should get."""
        claimed = await self.claim_entry(envelope)
        if isinstance(claimed, Handled):
            return claimed
        return await self.finish(claimed, traceparent)

    async def finish(self, claimed: Claimed, traceparent: str | None) -> Handled:
        """A claimed operation's call and record."""
        attempt = await self.attempt(claimed, traceparent)
        try:
            await self._holding(lambda: self.record(claimed, attempt))
        except Exception as error:
            if not is_transient_database_error(error):
                raise
            # The lease will expire and the reconciler will find out what happened; a
            # redelivery meanwhile is a duplicate (the operation is in flight).
            return Handled("retry_later", returned=error)
        return Handled("processed")

    async def _holding(self, step: Callable[[], Awaitable[T]]) -> T:
        """``step``, tried again with backoff while the database is away or too slow,
        the delivery unacknowledged in hand meanwhile. Raises the database's error once
        this consumer stops or has held it :data:`HOLD_AT_MOST_SECONDS`."""
        backoff = Backoff(first=HOLD_FIRST_RETRY_SECONDS, longest=HOLD_LONGEST_RETRY_SECONDS)
        held_since = time.monotonic()
        while True:
            try:
                return await step()
            except Exception as error:
                if (
                    not is_transient_database_error(error)
                    or self.stopping
                    or time.monotonic() - held_since > HOLD_AT_MOST_SECONDS
                ):
                    raise
                delay = backoff.next_delay()
                self.metrics.deliveries_held.inc()
                log(
                    logging.WARNING,
                    "consumer.database_unavailable",
                    "the database is away or too slow; the delivery stays in hand",
                    error=type(error).__name__,
                    attempt=backoff.failures,
                    retry_in=round(delay, 2),
                )
                await self._sleep(delay)

    async def claim(self, envelope: OperationMessage) -> Claimed | Skip:
        """Load, check and claim (see :class:`consumer.claims.Claims`)."""
        return await self.claims.claim(envelope)

    async def attempt(self, claimed: Claimed, traceparent: str | None = None) -> Attempt:
        """Call the tool once (see :meth:`consumer.effects.Effects.attempt`)."""
        return await self.effects.attempt(claimed, traceparent)

    async def record(self, claimed: Claimed, attempt: Attempt) -> None:
        """Record the outcome (see :meth:`consumer.effects.Effects.record`)."""
        await self.effects.record(claimed, attempt)

    async def dead_letter(self, message: Received, settlements: Settlements, *reasons: str) -> str:
        """Reject ``message`` to the dead-letter queue, counting one reason per operation
        it carries (one for a body that is no envelope)."""
        for reason in reasons:
            self.metrics.deliveries.labels("invalid").inc()
            self.metrics.dead_lettered.labels(reason).inc()
        log(
            logging.WARNING,
            "consumer.dead_lettered",
            "dead-lettered",
            reason=",".join(sorted(set(reasons))),
            message_id=safe_message_id(message.message_id),
        )
        await settlements.settle(message, Settlement.REJECT)
        return "invalid"

    async def _later(
        self, message: Received, settlements: Settlements, error: BaseException
    ) -> str:
        self.metrics.deliveries.labels("retry_later").inc()
        self.log_returned(error)
        await settlements.settle(message, Settlement.REQUEUE)
        return "retry_later"

    def log_returned(self, error: BaseException) -> None:
        log(
            logging.WARNING,
            "consumer.delivery_returned",
            "the database stayed away while this consumer stopped or held the delivery "
            "too long; it goes back to the queue",
            error=type(error).__name__,
        )
