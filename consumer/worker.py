"""The consumer: deliveries to effects, at most once per proven-absent outcome.

Per delivery: parse the thin envelope -> load the operation (the database is the only
thing trusted) -> claim ``prepared -> in_flight`` with a lease and a fencing token,
committed before any external call -> check the approval -> execute with the operation
id as idempotency key and a deadline -> record the outcome under the fencing token ->
ack. A delivery whose claim fails is a duplicate: acked, counted, never executed.

What an outcome leads to is decided in :mod:`consumer.policy`; unknown outcomes and
expired leases are the :class:`~consumer.reconciler.Reconciler`'s, which runs beside the
deliveries in the same process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import aiormq.exceptions
import pydantic
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage, ConsumerTag

from consumer import policy
from consumer.batching import Batcher
from consumer.database import APPLICATION_NAME, Database, transition_plan
from consumer.policy import LEASE_LOST_BEFORE_CALL, Attempt, AttemptOutcome
from consumer.reconciler import Reconciler
from consumer.telemetry import log, logger, span_attributes
from outbox import store, tracing
from outbox.backoff import Backoff
from outbox.broker import (
    SESSION_SETUP_SECONDS,
    DeclaredTopology,
    OperationMessage,
    Topology,
    broker_urls,
    establish_topology,
)
from outbox.broker import connect as connect_to_broker
from outbox.contracts import Registry, ToolContract
from outbox.daemon import Daemon, is_transient_database_error
from outbox.decisions import derive_intent
from outbox.errors import (
    ConfigurationError,
    IllegalTransition,
    SchemaMissing,
    ToolNotRegistered,
)
from outbox.metrics import ConsumerMetrics
from outbox.models import Operation
from outbox.outcomes import (
    DefinitiveRejection,
    ExecutionContext,
    NotSent,
    OutcomeUnknown,
)
from outbox.settings import Settings, redact_url
from outbox.states import EventName, OperationState
from outbox.store import AsyncStore

DEFAULT_METRICS_PORT = 9465
MAX_BODY_BYTES = 4096
S = OperationState


@dataclass(frozen=True)
class Claimed:
    """An operation this worker holds in flight, under the lease its claim took."""

    operation: Operation
    contract: ToolContract[Any]
    # On this process's monotonic clock, a time by which the lease has surely not yet
    # expired: the lease runs from the database's transaction start, which is later than
    # the moment this process began the claim's transaction.
    lease_safe_until: float = float("inf")
    # The input as the claim's checks validated it; validated again only when absent.
    tool_input: Any = None


@dataclass(frozen=True)
class Skip:
    """A delivery that will not run: its result label, and why it is dead-lettered if
    it is."""

    result: str
    dead_letter_reason: str | None = None


@dataclass(frozen=True)
class _Runnable:
    """A delivery that passed every check: the contract to claim it under, and its
    validated input (so the hot path validates it once)."""

    contract: ToolContract[Any]
    tool_input: Any


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
        self.database = Database(settings)
        self.reconciler = Reconciler(
            settings, registry, self.metrics, self.database, worker_id=self.worker_id
        )
        self._topology = Topology.from_settings(settings)
        self._broker_ready = False
        self._handlers: set[asyncio.Task[Any]] = set()
        # Group commit: the deliveries in hand share their claim transaction and their
        # outcome transaction, instead of two transactions each.
        self._claims = Batcher(self._prepare_many, limit=settings.prefetch)
        self._commits = Batcher(self._record_many, limit=settings.prefetch)

    def healthy(self) -> bool:
        return self._broker_ready and not self.stopping

    def stop(self) -> None:
        """Take no new deliveries and stop reconciling; the effects in hand finish."""
        super().stop()
        self.reconciler.stop()

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
                queue=self._topology.queue,
                database=redact_url(self.settings.libpq_url),
                **self.database.bounds.fields(),
            ):
                await self._require_schema()
                reconciler = asyncio.create_task(self.reconciler.run())
                try:
                    await self.keep_sessions(self._consume_session, self._session_lost)
                    # Stopped between sessions: what a lost session left in hand still
                    # finishes and records its outcome before the pool closes.
                    if self._handlers:
                        await asyncio.gather(*self._handlers, return_exceptions=True)
                finally:
                    reconciler.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reconciler
        finally:
            await self.close()

    async def _require_schema(self) -> None:
        """Refuse to run on a database without the outbox schema, as the dispatcher
        does: otherwise this process would answer /healthz and fail every delivery.
        A database that is away is waited for, since nothing can be consumed without it."""
        backoff = Backoff()
        while not self.stopping:
            try:
                present = await asyncio.to_thread(self.database.schema_present)
            except Exception as error:
                if not is_transient_database_error(error):
                    raise
                delay = backoff.next_delay()
                self.log(
                    logging.WARNING,
                    "connect_retry",
                    "could not connect; retrying",
                    peer="database",
                    attempt=backoff.failures,
                    error=type(error).__name__,
                    retry_in=round(delay, 2),
                )
                await self._sleep(delay)
                continue
            if not present:
                raise SchemaMissing()
            return

    def _session_lost(self, peer: str) -> None:
        self._broker_ready = False
        self.metrics.reconnects.inc()

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
            self._broker_ready = True
            self.log(logging.INFO, "session_ready", "session ready")
            stop = asyncio.ensure_future(self.wait_for_stop())
            lost = asyncio.ensure_future(closed.wait())
            try:
                await asyncio.wait([stop, lost], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                lost.cancel()
            self._broker_ready = False
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
        channel = await connection.channel()
        # A channel the broker closed, or a consumer it cancelled (a quorum queue's
        # leader moving after a restart), leaves the connection open and nothing
        # consuming: a session that ends that way is lost like a closed connection.
        channel.close_callbacks.add(lambda *_: closed.set())
        await channel.set_qos(prefetch_count=self.settings.prefetch)
        declared = await establish_topology(
            channel, self._topology, declare=self.settings.declare_topology
        )
        underlay = await channel.get_underlay_channel()

        async def cancelled_by_broker(*_: object) -> None:
            closed.set()

        underlay.on_consumer_cancel_callbacks.add(cancelled_by_broker)
        return declared, await declared.queue.consume(self._on_message)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        # aiormq runs this as a task of the channel and cancels it when the channel
        # closes. The effect in hand must not be cut off with it: its operation would
        # sit in flight until its lease ran out and then be looked up and called again.
        # The handling runs in a task this consumer owns, so a lost connection costs
        # only the ack (the redelivery is a duplicate the claim suppresses).
        handling = asyncio.create_task(self._deliver(message))
        self._handlers.add(handling)
        handling.add_done_callback(self._handlers.discard)
        await asyncio.shield(handling)

    async def _deliver(self, message: AbstractIncomingMessage) -> None:
        try:
            await self.handle(message)
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
                await message.nack(requeue=True)

    async def handle(self, message: AbstractIncomingMessage) -> str:
        """Handle one delivery; returns its result label (for metrics and tests)."""
        if len(message.body) > MAX_BODY_BYTES:
            return await self._dead_letter(message, "oversized")
        try:
            envelope = OperationMessage.model_validate_json(message.body)
        except pydantic.ValidationError:
            return await self._dead_letter(message, "malformed")
        try:
            claimed = await self.claim(envelope)
        except Exception as error:
            if not is_transient_database_error(error):
                raise
            return await self._later(message, error)
        if isinstance(claimed, Skip):
            if claimed.dead_letter_reason is not None:
                return await self._dead_letter(message, claimed.dead_letter_reason)
            self.metrics.deliveries.labels(claimed.result).inc()
            await message.ack()
            return claimed.result
        # Only a well-formed W3C traceparent may parent the span; any other header is ignored.
        headers = message.headers or {}
        attempt = await self.attempt(claimed, tracing.valid_traceparent(headers.get("traceparent")))
        try:
            await self.record(claimed, attempt)
        except Exception as error:
            if not is_transient_database_error(error):
                raise
            # The lease will expire and the reconciler will find out what happened; a
            # redelivery meanwhile is a duplicate (the operation is in flight).
            return await self._later(message, error)
        self.metrics.deliveries.labels("processed").inc()
        await message.ack()
        return "processed"

    async def claim(self, envelope: OperationMessage) -> Claimed | Skip:
        """Load, check and claim; shares its transaction with the deliveries that arrive
        in the same burst (see :meth:`_prepare_many`)."""
        return await self._claims.submit(envelope)

    async def _prepare_many(self, envelopes: list[OperationMessage]) -> list[Claimed | Skip]:
        """Load, check and claim a burst of deliveries in one transaction, committed
        before any of their external calls: one round trip loads them all, one statement
        claims them all, each with its own lease and a new fencing token."""
        began = time.monotonic()
        async with self.database.transaction() as connection:
            runner = await AsyncStore.on(connection)
            await self.database.remember_fingerprint_key(runner)
            operations = await runner.run(
                store.find_operations(list(dict.fromkeys(e.operation_id for e in envelopes)))
            )
            verdicts: list[Skip | _Runnable] = []
            wanted: dict[UUID, timedelta] = {}
            for envelope in envelopes:
                verdict = await self._check(runner, envelope, operations.get(envelope.operation_id))
                verdicts.append(verdict)
                if not isinstance(verdict, Skip):
                    lease = verdict.contract.deadline + timedelta(
                        seconds=self.settings.lease_margin
                    )
                    wanted.setdefault(envelope.operation_id, lease)
            claimed = await runner.run(
                store.claim_many(sorted(wanted.items()), owner=self.worker_id)
            )
            results: list[Claimed | Skip] = []
            for envelope, verdict in zip(envelopes, verdicts, strict=True):
                if isinstance(verdict, Skip):
                    results.append(verdict)
                    continue
                # One claim per operation: a second delivery of it in this burst, or one
                # whose claim another worker won since the read, is a duplicate.
                operation = claimed.pop(envelope.operation_id, None)
                if operation is None:
                    current = await runner.run(store.find_operation(envelope.operation_id))
                    results.append(
                        await _suppressed(runner, current or operations[envelope.operation_id])
                    )
                    continue
                lease_seconds = wanted[envelope.operation_id].total_seconds()
                results.append(
                    Claimed(
                        operation,
                        verdict.contract,
                        lease_safe_until=began + lease_seconds,
                        tool_input=verdict.tool_input,
                    )
                )
        return results

    async def _check(
        self, runner: AsyncStore, envelope: OperationMessage, operation: Operation | None
    ) -> Skip | _Runnable:
        """Why this delivery must not run (a skip), or the contract to claim it under
        with its validated input."""
        if operation is None:
            return Skip("invalid", "unknown_operation")
        if (
            operation.input_fingerprint != envelope.input_fingerprint
            or operation.tool_name != envelope.tool
            or operation.tool_version != envelope.tool_version
        ):
            return Skip("invalid", "fingerprint_mismatch")
        try:
            contract = self.registry.get(operation.tool_name, operation.tool_version)
        except ToolNotRegistered:
            log(
                logging.ERROR,
                "consumer.unknown_tool",
                "no registered tool can run it",
                id=operation.display_id,
            )
            if operation.state is S.PREPARED:
                # Evidence for the escalation that ends it if no consumer ever can run it.
                await runner.run(
                    store.append_event(
                        operation, EventName.DEAD_LETTERED, {"reason": "unknown_tool"}
                    )
                )
            return Skip("invalid", "unknown_tool")
        if operation.state is not S.PREPARED:
            return await _suppressed(runner, operation)
        # Trust only what can be derived: the stored row's fingerprint and approval flag
        # were written by whoever holds the agent's grant, and may have been forged.
        intent = derive_intent(contract, operation)
        if intent.disagreement is not None:
            return await self._tampered(runner, operation, contract, intent.disagreement)
        if intent.requires_approval:
            check = await runner.run(store.check_approval(operation.id))
            if not check.is_valid:
                await runner.run(
                    store.append_event(
                        operation,
                        EventName.APPROVAL_REQUIRED,
                        {"status": str(check.status), "policy": "approval_required"},
                    )
                )
                return Skip("awaiting_approval")
        if policy.replay_window_passed(operation, contract, now=datetime.now(UTC)):
            return await self._escalate_before_replay(runner, operation, contract)
        return _Runnable(contract, intent.tool_input)

    async def _escalate_before_replay(
        self, runner: AsyncStore, operation: Operation, contract: ToolContract[Any]
    ) -> Skip:
        decision = policy.escalation_before_replay(operation)
        try:
            await runner.run(transition_plan(operation, decision.transition))
        except IllegalTransition:
            return Skip("duplicate")  # a second delivery in the same burst escalated it
        self.metrics.escalations.labels(contract.name, str(decision.reason)).inc()
        return Skip("escalated")

    async def _tampered(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        disagreement: str,
    ) -> Skip:
        """Never execute a row that disagrees with its own input: write down which check
        failed and hand it to a person."""
        self.metrics.tampered.labels(contract.name, disagreement).inc()
        log(
            logging.ERROR,
            "consumer.tampered",
            "the row disagrees with its own input; escalated",
            id=operation.display_id,
            tool=contract.name,
            check=disagreement,
        )
        await runner.run(store.append_event(operation, EventName.TAMPERED, {"check": disagreement}))
        try:
            await runner.run(
                store.transition(
                    operation.id,
                    source=S.PREPARED,
                    target=S.ESCALATED,
                    attributes={"reason": "tampered", "check": disagreement},
                )
            )
        except IllegalTransition:
            # A second delivery of it in the same burst: the first one escalated it.
            return Skip("duplicate")
        self.metrics.escalations.labels(contract.name, "tampered").inc()
        return Skip("tampered")

    async def attempt(self, claimed: Claimed, traceparent: str | None = None) -> Attempt:
        """Call the tool once for ``claimed``, in a span that continues the decision's
        trace; never raises, whatever the tool does."""
        operation, contract = claimed.operation, claimed.contract
        with tracing.span(
            f"outbox.attempt {contract.name}",
            parent_traceparent=traceparent,
            attributes=span_attributes(operation, contract, self.database.fingerprint_key),
            kind="consumer",
        ) as traced:
            attempt = await self._execute(claimed)
            traced.set_attributes(
                {"outbox.outcome": str(attempt.outcome), "outbox.code": attempt.code}
            )
            if attempt.effect is not None:
                traced.set_attributes(
                    {"outbox.provider_reference": attempt.effect.provider_reference}
                )
            traced.set_status(attempt.outcome is AttemptOutcome.COMMITTED, attempt.code)
        return attempt

    async def _execute(self, claimed: Claimed) -> Attempt:
        operation, contract = claimed.operation, claimed.contract
        # The call must end, and its outcome be recorded, within the lease: a process that
        # stalled after its claim (a pause, a slow link) calls with what is left or, with
        # nothing left, not at all; another worker may already be reconciling it.
        left = claimed.lease_safe_until - self.settings.lease_margin - time.monotonic()
        seconds = min(contract.deadline.total_seconds(), left)
        if seconds <= 0:
            log(
                logging.WARNING,
                "consumer.lease_lost_before_call",
                "the lease ran out before the call; not calling",
                id=operation.display_id,
            )
            return Attempt(AttemptOutcome.NOT_SENT, LEASE_LOST_BEFORE_CALL)
        context = ExecutionContext(
            operation_id=operation.id,
            attempt=operation.attempts,
            deadline=time.monotonic() + seconds,
        )
        started = time.monotonic()
        try:
            tool_input = claimed.tool_input
            if tool_input is None:
                tool_input = contract.input_model.model_validate(operation.input)
            async with asyncio.timeout(seconds):
                effect = await contract.execute(tool_input, context)
            attempt = Attempt(AttemptOutcome.COMMITTED, "ok", effect)
        except DefinitiveRejection as rejection:
            attempt = Attempt(AttemptOutcome.REJECTED, rejection.code)
        except NotSent as not_sent:
            attempt = Attempt(AttemptOutcome.NOT_SENT, not_sent.code)
        except OutcomeUnknown as unknown:
            attempt = Attempt(AttemptOutcome.OUTCOME_UNKNOWN, unknown.code)
        except TimeoutError:
            context.cancelled.set()
            attempt = Attempt(AttemptOutcome.OUTCOME_UNKNOWN, "deadline_exceeded")
        except Exception as error:
            # A tool that cannot say what happened may have done it: unknown, not retry.
            log(
                logging.WARNING,
                "consumer.tool_error",
                "the tool raised; the outcome is unknown",
                id=operation.display_id,
                tool=contract.name,
                error=type(error).__name__,
            )
            attempt = Attempt(AttemptOutcome.OUTCOME_UNKNOWN, "tool_error")
        self.metrics.effect_duration.labels(contract.name).observe(time.monotonic() - started)
        self.metrics.effect_attempts.labels(contract.name, str(attempt.outcome)).inc()
        return attempt

    async def record(self, claimed: Claimed, attempt: Attempt) -> None:
        """Record the outcome where :func:`consumer.policy.after_attempt` says it leads,
        under the claim's fencing token. Confirmed effects share one transaction with
        those that finish in the same burst."""
        if attempt.outcome is AttemptOutcome.COMMITTED:
            await self._commits.submit((claimed, attempt))
        else:
            await self._record_one(claimed, attempt)

    async def _record_many(self, done: list[tuple[Claimed, Attempt]]) -> list[None]:
        effects = []
        for claimed, attempt in done:
            assert attempt.effect is not None
            effects.append(
                store.ConfirmedEffect(
                    operation=claimed.operation,
                    provider_reference=attempt.effect.provider_reference,
                    result=attempt.effect.result,
                    attributes={"attempt": claimed.operation.attempts},
                )
            )
        committed = await self.database.run(store.commit_many(effects))
        for claimed, attempt in done:
            if claimed.operation.id not in committed:
                # Fenced or moved meanwhile: the single-row write finds out which, and logs it.
                await self._record_one(claimed, attempt)
        return [None] * len(done)

    async def _record_one(self, claimed: Claimed, attempt: Attempt) -> None:
        operation = claimed.operation
        move = policy.after_attempt(operation, claimed.contract, attempt)
        try:
            await self.database.run(transition_plan(operation, move))
            if move.then is not None:
                # The effect may have happened and no lookup can tell: a person decides.
                self.metrics.escalations.labels(claimed.contract.name, str(move.then.reason)).inc()
        except IllegalTransition as fenced:
            # Another process took the operation over (our lease expired): its record
            # wins; ours would overwrite evidence. The reconciler has or will settle it.
            log(
                logging.WARNING,
                "consumer.write_fenced",
                "another process took the operation over; its record wins",
                id=operation.display_id,
                token=operation.lease_token,
                outcome=str(attempt.outcome),
                reason=type(fenced).__name__,
            )

    async def _dead_letter(
        self,
        message: AbstractIncomingMessage,
        reason: str,
        envelope: OperationMessage | None = None,
    ) -> str:
        self.metrics.deliveries.labels("invalid").inc()
        self.metrics.dead_lettered.labels(reason).inc()
        log(
            logging.WARNING,
            "consumer.dead_lettered",
            "dead-lettered",
            reason=reason,
            message_id=_safe_id(message.message_id),
        )
        await message.reject(requeue=False)
        return "invalid"

    async def _later(self, message: AbstractIncomingMessage, error: BaseException) -> str:
        self.metrics.deliveries.labels("retry_later").inc()
        log(
            logging.WARNING,
            "consumer.database_unavailable",
            "the database is unavailable; the message goes back to the queue",
            error=type(error).__name__,
        )
        await self._sleep(1.0)
        await message.nack(requeue=True)
        return "retry_later"


async def _suppressed(runner: AsyncStore, operation: Operation) -> Skip:
    """A duplicate delivery, written down: the event is the durable count of what the
    dedupe stopped (metrics die with the process), and an operator reading the timeline
    sees the broker's redeliveries beside the one attempt."""
    await runner.run(
        store.append_event(
            operation, EventName.DELIVERY_SUPPRESSED, {"state": str(operation.state)}
        )
    )
    return Skip("duplicate")


def _safe_id(value: str | None) -> str:
    if value and len(value) <= 64 and value.replace("-", "").replace("_", "").isalnum():
        return value
    return "-"
