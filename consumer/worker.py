"""The consumer: deliveries to effects, at most once per proven-absent outcome.

Per delivery: parse the thin envelope -> load the operation (the database is the only
thing trusted) -> claim ``prepared -> in_flight`` with a lease and a fencing token,
committed before any external call -> check the approval -> execute with the operation
id as idempotency key and a deadline -> record the outcome under the fencing token ->
ack. A delivery whose claim fails is a duplicate: acked, counted, never executed.

The reconciler (a loop in the same process) looks up every unknown outcome before
anything else may happen to it, and takes over operations whose worker died holding
the lease: an expired lease means *outcome unknown*, not "retry".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar
from uuid import UUID

import aiormq.exceptions
import psycopg
import pydantic
import sqlalchemy.exc
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage, ConsumerTag
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from outbox import store, tracing
from outbox.broker import (
    SESSION_SETUP_SECONDS,
    DeclaredTopology,
    OperationMessage,
    Topology,
    amqp_url_with_heartbeat,
    establish_topology,
)
from outbox.broker import connect as connect_to_broker
from outbox.connections import DatabaseBounds, bounded_transaction
from outbox.contracts import OnUnknown, Registry, SideEffect, ToolContract
from outbox.decisions import derive_intent
from outbox.errors import (
    ConfigurationError,
    IllegalTransition,
    OutboxError,
    SchemaMissing,
    ToolNotRegistered,
    TransientDatabaseError,
)
from outbox.fingerprint_key import keyed_fingerprint
from outbox.metrics import ConsumerMetrics
from outbox.models import Operation
from outbox.observability import serve_http
from outbox.outcomes import (
    DefinitiveRejection,
    EffectResult,
    ExecutionContext,
    Found,
    NotFound,
    NotSent,
    OutcomeUnknown,
    Reconciliation,
    StillUnknown,
)
from outbox.settings import Settings, redact_url
from outbox.signals import Stoppable
from outbox.states import EventName, OperationState
from outbox.store import AsyncStore, Plan

logger = logging.getLogger(__name__)
T = TypeVar("T")
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")

DEFAULT_METRICS_PORT = 9465
APPLICATION_NAME = "outbox-consumer"
MAX_BODY_BYTES = 4096
# The code of an attempt a worker gave up before calling: its lease ran out first.
LEASE_LOST_BEFORE_CALL = "lease_lost_before_call"
STALE_SWEEP_SECONDS = 30.0
S = OperationState

# Database failures a later attempt may not meet: leave the message for redelivery.
# A database that is away: what the store raises, and what SQLAlchemy raises when it
# cannot even open a connection for a transaction (that happens before the store runs).
TRANSIENT_DATABASE = (
    TransientDatabaseError,
    psycopg.OperationalError,
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    OSError,
)
RECONCILER_BACKOFF_SECONDS = 1.0


def _log(level: int, action: str, message: str, **fields: Any) -> None:
    logger.log(level, message, extra={"action": action, **fields})


@dataclass(frozen=True)
class _Claimed:
    operation: Operation
    contract: ToolContract[Any]
    # On this process's monotonic clock, a time by which the lease has surely not yet
    # expired: the lease runs from the database's transaction start, which is later than
    # the moment this process began the claim's transaction.
    lease_safe_until: float = float("inf")
    # The input as the claim's checks validated it; validated again only when absent.
    tool_input: Any = None


@dataclass(frozen=True)
class _Runnable:
    """A delivery that passed every check: the contract to claim it under, and its
    validated input (so the hot path validates it once)."""

    contract: ToolContract[Any]
    tool_input: Any


@dataclass(frozen=True)
class _Skip:
    result: str
    dead_letter_reason: str | None = None


@dataclass(frozen=True)
class _Attempt:
    outcome: str  # committed | rejected | not_sent | outcome_unknown
    code: str
    effect: EffectResult | None = None


class _Batcher(Generic[ItemT, ResultT]):
    """Group commit: what is submitted while a flush runs goes together into the next.

    A flush of one item starts as soon as one is submitted, so an idle consumer adds no
    wait; under load each flush takes everything that queued up meanwhile (up to
    ``limit``). A flush that raises raises in every submitter of its batch.
    """

    def __init__(
        self, flush: Callable[[list[ItemT]], Awaitable[list[ResultT]]], *, limit: int
    ) -> None:
        self._flush = flush
        self._limit = max(1, limit)
        self._queue: list[tuple[ItemT, asyncio.Future[ResultT]]] = []
        self._running: asyncio.Task[None] | None = None

    async def submit(self, item: ItemT) -> ResultT:
        future: asyncio.Future[ResultT] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self._limit], self._queue[self._limit :]
            try:
                results = await self._flush([item for item, _ in batch])
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as error:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)


class Consumer(Stoppable):
    def __init__(
        self, settings: Settings, registry: Registry, metrics: ConsumerMetrics | None = None
    ) -> None:
        if not len(registry):
            raise ConfigurationError(
                "a consumer needs at least one registered tool: the --tools modules hold none"
            )
        super().__init__()
        self.settings = settings
        self.registry = registry
        self.metrics = metrics or ConsumerMetrics.create()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{id(self) % 10_000:04d}"
        self.metrics_port: int | None = None
        self._topology = Topology.from_settings(settings)
        self._broker_ready = False
        self._handlers: set[asyncio.Task[Any]] = set()
        self._engine: AsyncEngine | None = None
        self.database_bounds = DatabaseBounds.from_settings(settings)
        # Read on the first burst (then remembered): spans show keyed short fingerprints.
        self._fingerprint_key: str | None = None
        # Group commit: the deliveries in hand share their claim transaction and their
        # outcome transaction, instead of two transactions each.
        self._claims = _Batcher(self._prepare_many, limit=settings.prefetch)
        self._commits = _Batcher(self._record_many, limit=settings.prefetch)

    # --- control ---------------------------------------------------------------------

    def healthy(self) -> bool:
        return self._broker_ready and not self.stopping

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            # No pre-ping: it is a round trip per checkout with no deadline of its own. A
            # dead pooled connection fails its transaction's first statement instead (a
            # transient error: the delivery comes back), and SQLAlchemy discards the pool.
            self._engine = create_async_engine(
                self.settings.sqlalchemy_url,
                pool_size=self.settings.prefetch + 2,
                max_overflow=4,
                connect_args={
                    "application_name": APPLICATION_NAME,
                    **self.database_bounds.libpq_parameters(),
                },
            )
        return self._engine

    def _transaction(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """A transaction whose connection is cut past its deadline, so a silent link
        never holds an operation's row beyond the lease."""
        return bounded_transaction(self.engine, self.database_bounds.transaction)

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.dispose()
            self._engine = None

    async def _run_plan(self, plan: Plan[T]) -> T:
        async with self._transaction() as connection:
            return await (await AsyncStore.on(connection)).run(plan)

    # --- daemon ----------------------------------------------------------------------

    async def run(self) -> None:
        """Consume and reconcile until :meth:`stop`; in-flight effects finish first."""
        port = self.settings.metrics_port
        port = DEFAULT_METRICS_PORT if port is None else port
        try:
            async with serve_http(
                self.settings.metrics_host, port, self.metrics.registry, self.healthy
            ) as bound:
                self.metrics_port = bound
                _log(
                    logging.INFO,
                    "consumer.started",
                    f"consumer.started worker={self.worker_id} metrics_port={bound} "
                    f"tools={self.registry.describe()!r} queue={self._topology.queue} "
                    f"database={redact_url(self.settings.libpq_url)} "
                    f"{self.database_bounds.describe()}",
                )
                await self._require_schema()
                reconciler = asyncio.create_task(self._reconcile_loop())
                try:
                    await self._consume_loop()
                finally:
                    reconciler.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reconciler
        finally:
            await self.close()
        _log(logging.INFO, "consumer.stopped", f"consumer.stopped worker={self.worker_id}")

    async def _require_schema(self) -> None:
        """Refuse to run on a database without the outbox schema, as the dispatcher
        does: otherwise this process would answer /healthz and fail every delivery.
        A database that is away is waited for, since nothing can be consumed without it."""
        failures = 0
        while not self.stopping:
            try:
                present = await asyncio.to_thread(self._schema_present)
            except TRANSIENT_DATABASE as error:
                failures += 1
                delay = min(10.0, 0.2 * 2 ** (failures - 1))
                _log(
                    logging.WARNING,
                    "consumer.connect_retry",
                    f"consumer.connect_retry peer=database attempt={failures} "
                    f"error={type(error).__name__} retry_in={delay:.1f}s",
                )
                await self._sleep(delay)
                continue
            if not present:
                raise SchemaMissing()
            return

    def _schema_present(self) -> bool:
        with psycopg.connect(
            self.settings.libpq_url,
            application_name=APPLICATION_NAME,
            **self.database_bounds.libpq_parameters(),
        ) as connection:
            # An older schema lacks what this consumer reads (outbox_deployment): that
            # too is "run outbox migrate".
            return store.schema_is_current(connection)

    async def _consume_loop(self) -> None:
        failures = 0
        while not self.stopping:
            started = time.monotonic()
            try:
                await self._consume_session()
            except (aiormq.exceptions.AMQPError, ConnectionError, OSError, TimeoutError) as error:
                self._broker_ready = False
                self.metrics.reconnects.inc()
                failures = failures + 1 if time.monotonic() - started < 10 else 1
                delay = min(10.0, 0.2 * 2 ** (failures - 1))
                _log(
                    logging.WARNING,
                    "consumer.session_lost",
                    f"consumer.session_lost error={type(error).__name__} retry_in={delay:.1f}s",
                )
                await self._sleep(delay)

    async def _consume_session(self) -> None:
        url = amqp_url_with_heartbeat(
            self.settings.amqp_url.get_secret_value(), self.settings.amqp_heartbeat
        )
        async with asyncio.timeout(SESSION_SETUP_SECONDS):
            connection = await connect_to_broker(
                url, connection_name=f"{APPLICATION_NAME} {self.worker_id}"
            )
        closed = asyncio.Event()
        connection.close_callbacks.add(lambda *_: closed.set())
        async with connection:
            async with asyncio.timeout(SESSION_SETUP_SECONDS):
                declared, tag = await self._start_consuming(connection, closed)
            self._broker_ready = True
            _log(logging.INFO, "consumer.session_ready", "consumer.session_ready")
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
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self.handle(message)
        except (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError) as error:
            # The outcome is already recorded; the broker will redeliver the unacked
            # message and the claim will see it as a duplicate.
            _log(
                logging.WARNING,
                "consumer.ack_failed",
                f"consumer.ack_failed error={type(error).__name__}",
            )
        except Exception as error:
            # Anything unforeseen: leave the message to the broker (redelivered, and
            # dead-lettered past the delivery limit) rather than lose track of it.
            _log(
                logging.ERROR,
                "consumer.delivery_failed",
                f"consumer.delivery_failed error={type(error).__name__}",
            )
            await self._sleep(1.0)  # no hot loop of redeliveries while it persists
            with contextlib.suppress(Exception):
                await message.nack(requeue=True)
        finally:
            if task is not None:
                self._handlers.discard(task)

    # --- one delivery ----------------------------------------------------------------

    async def handle(self, message: AbstractIncomingMessage) -> str:
        """Handle one delivery; returns its result label (for metrics and tests)."""
        if len(message.body) > MAX_BODY_BYTES:
            return await self._dead_letter(message, "oversized")
        try:
            envelope = OperationMessage.model_validate_json(message.body)
        except pydantic.ValidationError:
            return await self._dead_letter(message, "malformed")
        try:
            prepared = await self._prepare(envelope)
        except TRANSIENT_DATABASE as error:
            return await self._later(message, error)
        if isinstance(prepared, _Skip):
            if prepared.dead_letter_reason is not None:
                return await self._dead_letter(message, prepared.dead_letter_reason)
            self.metrics.deliveries.labels(prepared.result).inc()
            await message.ack()
            return prepared.result
        # Only a well-formed W3C traceparent may parent the span; any other header is ignored.
        headers = message.headers or {}
        attempt = await self._attempt(
            prepared, tracing.valid_traceparent(headers.get("traceparent"))
        )
        try:
            await self._record(prepared, attempt)
        except TRANSIENT_DATABASE as error:
            # The lease will expire and the reconciler will find out what happened; a
            # redelivery meanwhile is a duplicate (the operation is in flight).
            return await self._later(message, error)
        self.metrics.deliveries.labels("processed").inc()
        await message.ack()
        return "processed"

    async def _prepare(self, envelope: OperationMessage) -> _Claimed | _Skip:
        """Load, check and claim; shares its transaction with the deliveries that arrive
        in the same burst (see :meth:`_prepare_many`)."""
        return await self._claims.submit(envelope)

    async def _prepare_many(self, envelopes: list[OperationMessage]) -> list[_Claimed | _Skip]:
        """Load, check and claim a burst of deliveries in one transaction, committed
        before any of their external calls: one round trip loads them all, one statement
        claims them all, each with its own lease and a new fencing token."""
        began = time.monotonic()
        async with self._transaction() as connection:
            runner = await AsyncStore.on(connection)
            if self._fingerprint_key is None:
                self._fingerprint_key = await runner.run(store.fingerprint_key())
            operations = await runner.run(
                store.find_operations(list(dict.fromkeys(e.operation_id for e in envelopes)))
            )
            verdicts: list[_Skip | _Runnable] = []
            wanted: dict[UUID, timedelta] = {}
            for envelope in envelopes:
                verdict = await self._check(runner, envelope, operations.get(envelope.operation_id))
                verdicts.append(verdict)
                if not isinstance(verdict, _Skip):
                    lease = verdict.contract.deadline + timedelta(
                        seconds=self.settings.lease_margin
                    )
                    wanted.setdefault(envelope.operation_id, lease)
            claimed = await runner.run(
                store.claim_many(sorted(wanted.items()), owner=self.worker_id)
            )
            results: list[_Claimed | _Skip] = []
            for envelope, verdict in zip(envelopes, verdicts, strict=True):
                if isinstance(verdict, _Skip):
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
                    _Claimed(
                        operation,
                        verdict.contract,
                        lease_safe_until=began + lease_seconds,
                        tool_input=verdict.tool_input,
                    )
                )
        return results

    async def _check(
        self, runner: AsyncStore, envelope: OperationMessage, operation: Operation | None
    ) -> _Skip | _Runnable:
        """Why this delivery must not run (a skip), or the contract to claim it under
        with its validated input."""
        if operation is None:
            return _Skip("invalid", "unknown_operation")
        if (
            operation.input_fingerprint != envelope.input_fingerprint
            or operation.tool_name != envelope.tool
            or operation.tool_version != envelope.tool_version
        ):
            return _Skip("invalid", "fingerprint_mismatch")
        try:
            contract = self.registry.get(operation.tool_name, operation.tool_version)
        except ToolNotRegistered as missing:
            _log(
                logging.ERROR,
                "consumer.unknown_tool",
                f"consumer.unknown_tool id={operation.display_id} {missing}",
            )
            if operation.state is S.PREPARED:
                # Evidence for the escalation that ends it if no consumer ever can run it.
                await runner.run(
                    store.append_event(
                        operation, EventName.DEAD_LETTERED, {"reason": "unknown_tool"}
                    )
                )
            return _Skip("invalid", "unknown_tool")
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
                return _Skip("awaiting_approval")
        return _Runnable(contract, intent.tool_input)

    async def _tampered(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        disagreement: str,
    ) -> _Skip:
        """Never execute a row that disagrees with its own input: write down which check
        failed and hand it to a person."""
        self.metrics.tampered.labels(contract.name, disagreement).inc()
        _log(
            logging.ERROR,
            "consumer.tampered",
            f"consumer.tampered id={operation.display_id} tool={contract.name} "
            f"check={disagreement}",
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
            return _Skip("duplicate")
        self.metrics.escalations.labels(contract.name, "tampered").inc()
        return _Skip("tampered")

    async def _attempt(self, claimed: _Claimed, traceparent: str | None = None) -> _Attempt:
        """:meth:`_execute` in a span that continues the decision's trace."""
        operation, contract = claimed.operation, claimed.contract
        with tracing.span(
            f"outbox.attempt {contract.name}",
            parent_traceparent=traceparent,
            attributes=_span_attributes(operation, contract, self._fingerprint_key),
            kind="consumer",
        ) as traced:
            attempt = await self._execute(claimed)
            traced.set_attributes({"outbox.outcome": attempt.outcome, "outbox.code": attempt.code})
            if attempt.effect is not None:
                traced.set_attributes(
                    {"outbox.provider_reference": attempt.effect.provider_reference}
                )
            traced.set_status(attempt.outcome == "committed", attempt.code)
        return attempt

    async def _execute(self, claimed: _Claimed) -> _Attempt:
        operation, contract = claimed.operation, claimed.contract
        # The call must end, and its outcome be recorded, within the lease: a process that
        # stalled after its claim (a pause, a slow link) calls with what is left or, with
        # nothing left, not at all; another worker may already be reconciling it.
        left = claimed.lease_safe_until - self.settings.lease_margin - time.monotonic()
        seconds = min(contract.deadline.total_seconds(), left)
        if seconds <= 0:
            _log(
                logging.WARNING,
                "consumer.lease_lost_before_call",
                f"consumer.lease_lost_before_call id={operation.display_id}",
            )
            return _Attempt("not_sent", LEASE_LOST_BEFORE_CALL)
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
            attempt = _Attempt("committed", "ok", effect)
        except DefinitiveRejection as rejection:
            attempt = _Attempt("rejected", rejection.code)
        except NotSent as not_sent:
            attempt = _Attempt("not_sent", not_sent.code)
        except OutcomeUnknown as unknown:
            attempt = _Attempt("outcome_unknown", unknown.code)
        except TimeoutError:
            context.cancelled.set()
            attempt = _Attempt("outcome_unknown", "deadline_exceeded")
        except Exception as error:
            # A tool that cannot say what happened may have done it: unknown, not retry.
            _log(
                logging.WARNING,
                "consumer.tool_error",
                f"consumer.tool_error id={operation.display_id} tool={contract.name} "
                f"error={type(error).__name__}",
            )
            attempt = _Attempt("outcome_unknown", "tool_error")
        self.metrics.effect_duration.labels(contract.name).observe(time.monotonic() - started)
        self.metrics.effect_attempts.labels(contract.name, attempt.outcome).inc()
        return attempt

    async def _record(self, claimed: _Claimed, attempt: _Attempt) -> None:
        """Record the outcome under the claim's fencing token. Confirmed effects share
        one transaction with those that finish in the same burst."""
        if attempt.outcome == "committed":
            await self._commits.submit((claimed, attempt))
        else:
            await self._record_one(claimed, attempt)

    async def _record_many(self, done: list[tuple[_Claimed, _Attempt]]) -> list[None]:
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
        committed = await self._run_plan(store.commit_many(effects))
        for claimed, attempt in done:
            if claimed.operation.id not in committed:
                # Fenced or moved meanwhile: the single-row write finds out which, and logs it.
                await self._record_one(claimed, attempt)
        return [None] * len(done)

    async def _record_one(self, claimed: _Claimed, attempt: _Attempt) -> None:
        operation, contract = claimed.operation, claimed.contract
        common: dict[str, Any] = {"lease_token": operation.lease_token, "source": S.IN_FLIGHT}
        attributes = {"attempt": operation.attempts}
        if attempt.outcome == "committed":
            assert attempt.effect is not None
            plan = store.transition(
                operation.id,
                target=S.COMMITTED,
                attributes=attributes,
                provider_reference=attempt.effect.provider_reference,
                result=dict(attempt.effect.result),
                **common,
            )
        elif attempt.outcome == "rejected":
            plan = store.transition(
                operation.id,
                target=S.REJECTED,
                attributes=attributes,
                error_class=attempt.code,
                **common,
            )
        elif attempt.outcome == "not_sent" and (
            # Never called: neither the tool's retry budget nor its codes apply.
            attempt.code == LEASE_LOST_BEFORE_CALL
            or contract.retry.may_retry(operation.attempts, attempt.code)
        ):
            plan = store.transition(
                operation.id,
                target=S.PREPARED,
                attributes={**attributes, "policy": "retry_not_sent"},
                error_class=attempt.code,
                delay=contract.retry.backoff(operation.attempts),
                **common,
            )
        elif attempt.outcome == "not_sent":
            # Every attempt provably never left: the effect did not happen, for good.
            plan = store.transition(
                operation.id,
                target=S.REJECTED,
                attributes={**attributes, "policy": "retry_budget_exhausted"},
                error_class=attempt.code,
                **common,
            )
        else:
            # The first lookup waits one backoff step: a provider that is still finishing
            # the request would only answer "in progress".
            plan = store.transition(
                operation.id,
                target=S.OUTCOME_UNKNOWN,
                attributes=attributes,
                error_class=attempt.code,
                delay=contract.retry.initial_backoff,
                **common,
            )
        try:
            await self._run_plan(plan)
        except IllegalTransition as fenced:
            # Another process took the operation over (our lease expired): its record
            # wins; ours would overwrite evidence. The reconciler has or will settle it.
            _log(
                logging.WARNING,
                "consumer.write_fenced",
                f"consumer.write_fenced id={operation.display_id} token={operation.lease_token} "
                f"outcome={attempt.outcome} reason={type(fenced).__name__}",
            )

    async def _dead_letter(
        self,
        message: AbstractIncomingMessage,
        reason: str,
        envelope: OperationMessage | None = None,
    ) -> str:
        self.metrics.deliveries.labels("invalid").inc()
        self.metrics.dead_lettered.labels(reason).inc()
        _log(
            logging.WARNING,
            "consumer.dead_lettered",
            f"consumer.dead_lettered reason={reason} message_id={_safe_id(message.message_id)}",
            reason=reason,
        )
        await message.reject(requeue=False)
        return "invalid"

    async def _later(self, message: AbstractIncomingMessage, error: BaseException) -> str:
        self.metrics.deliveries.labels("retry_later").inc()
        _log(
            logging.WARNING,
            "consumer.database_unavailable",
            f"consumer.database_unavailable error={type(error).__name__}",
        )
        await self._sleep(1.0)
        await message.nack(requeue=True)
        return "retry_later"

    # --- reconciler ------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        last_sweep = 0.0
        while not self.stopping:
            try:
                if time.monotonic() - last_sweep > self._stale_sweep_seconds:
                    last_sweep = time.monotonic()
                    await self.requeue_stale()
                busy = await self.reconcile_once()
            except (OutboxError, *TRANSIENT_DATABASE) as error:
                # The loop outlives any one failure: it is what settles unknown outcomes.
                _log(
                    logging.WARNING,
                    "consumer.reconcile_failed",
                    f"consumer.reconcile_failed error={type(error).__name__}",
                )
                busy = 0
            except Exception as error:
                # Nor an unforeseen one: a reconciler that died while this process goes
                # on consuming would leave expired leases and unknown outcomes unsettled
                # with nothing to show for it. Loudly, then again after a pause.
                _log(
                    logging.ERROR,
                    "consumer.reconcile_crashed",
                    f"consumer.reconcile_crashed error={type(error).__name__} "
                    f"where={_raised_at(error)}",
                )
                await self._sleep(RECONCILER_BACKOFF_SECONDS)
                busy = 0
            if not busy:
                await self._sleep(self.settings.reconcile_interval)

    @property
    def _stale_sweep_seconds(self) -> float:
        # Twice per requeue period at least, so a stale operation waits at most 1.5x it.
        return min(STALE_SWEEP_SECONDS, self.settings.requeue_stale_after.total_seconds() / 2)

    async def requeue_stale(self) -> list[Any]:
        """Queue again prepared operations that no message has reached for
        ``requeue_stale_after`` (their message was dead-lettered or lost); escalate those
        queued again too often already; end as rejected those whose approval was denied
        and never granted. Nothing prepared waits forever."""
        settings = self.settings
        escalated = await self._run_plan(
            store.escalate_undeliverable(
                settings.requeue_stale_after,
                settings.undeliverable_after_requeues,
                settings.reconcile_batch,
            )
        )
        requeued = await self._run_plan(
            store.requeue_stale_prepared(settings.requeue_stale_after, settings.reconcile_batch)
        )
        rejected = await self._run_plan(
            store.reject_denied_operations(settings.approval_denial_grace, settings.reconcile_batch)
        )
        for _, tool in escalated:
            self.metrics.escalations.labels(tool, "undeliverable").inc()
        for count, action in (
            (len(escalated), "escalated_undeliverable"),
            (len(requeued), "requeued_stale"),
            (len(rejected), "rejected_denied"),
        ):
            if count:
                _log(
                    logging.WARNING,
                    f"consumer.{action}",
                    f"consumer.{action} operations={count}",
                )
        return requeued

    async def reconcile_once(self) -> int:
        """One reconciler pass; returns how many operations it took up."""
        lookups: list[_Claimed] = []
        async with self._transaction() as connection:
            runner = await AsyncStore.on(connection)
            if self._fingerprint_key is None:
                self._fingerprint_key = await runner.run(store.fingerprint_key())
            candidates = await runner.run(
                store.claim_reconciliation_batch(self.settings.reconcile_batch)
            )
            for operation in candidates:
                try:
                    contract = self.registry.get(operation.tool_name, operation.tool_version)
                except ToolNotRegistered:
                    continue  # a consumer that has the tool will take it
                lookup = await self._triage(runner, operation, contract)
                if lookup is not None:
                    lookups.append(lookup)
        if lookups:
            await asyncio.gather(*(self._look_up(claimed) for claimed in lookups))
        return len(candidates)

    async def _triage(
        self, runner: AsyncStore, operation: Operation, contract: ToolContract[Any]
    ) -> _Claimed | None:
        """Decide what an unknown outcome needs; returns it leased if it needs a lookup."""
        if operation.state is S.IN_FLIGHT:
            operation = await runner.run(
                store.transition(
                    operation.id,
                    source=S.IN_FLIGHT,
                    target=S.OUTCOME_UNKNOWN,
                    lease_token=operation.lease_token,
                    error_class="lease_expired",
                    attributes={"attempt": operation.attempts, "policy": "lease_expired"},
                )
            )
        plan = _unknown_outcome_policy(operation, contract)
        if plan == "reconcile":
            lease = contract.deadline + timedelta(seconds=self.settings.lease_margin)
            leased = await runner.run(
                store.lease_for_reconciliation(operation, owner=self.worker_id, lease=lease)
            )
            return _Claimed(leased, contract) if leased is not None else None
        if plan == "retry":
            await runner.run(
                store.transition(
                    operation.id,
                    source=S.OUTCOME_UNKNOWN,
                    target=S.PREPARED,
                    lease_token=operation.lease_token,
                    attributes={"policy": f"retry_{contract.side_effect}"},
                    delay=contract.retry.backoff(max(1, operation.attempts)),
                )
            )
            return None
        await self._escalate(runner, operation, contract, reason=plan)
        return None

    async def _escalate(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        *,
        reason: str,
        lookup_code: str | None = None,
    ) -> None:
        """Hand the operation to a person, with the evidence gathered so far."""
        await runner.run(
            store.transition(
                operation.id,
                source=S.OUTCOME_UNKNOWN,
                target=S.ESCALATED,
                lease_token=operation.lease_token,
                attributes={
                    "reason": reason,
                    "attempts": operation.attempts,
                    "reconcile_attempts": operation.reconcile_attempts + (1 if lookup_code else 0),
                    "last_error": lookup_code or operation.last_error_class,
                },
                error_class=lookup_code,
                reconcile_attempt=lookup_code is not None,
            )
        )
        self.metrics.escalations.labels(contract.name, reason).inc()

    async def _look_up(self, claimed: _Claimed) -> None:
        operation, contract = claimed.operation, claimed.contract
        assert contract.reconcile is not None
        seconds = contract.deadline.total_seconds()
        context = ExecutionContext(
            operation_id=operation.id,
            attempt=operation.attempts,
            deadline=time.monotonic() + seconds,
        )
        result: Reconciliation
        # No message here to carry a traceparent: a new trace, tied to the operation by id.
        with tracing.span(
            f"outbox.reconcile {contract.name}",
            parent_traceparent=None,
            attributes={
                **_span_attributes(operation, contract, self._fingerprint_key),
                "outbox.reconcile_attempt": operation.reconcile_attempts + 1,
            },
        ) as traced:
            try:
                tool_input = contract.input_model.model_validate(operation.input)
                async with asyncio.timeout(seconds):
                    result = await contract.reconcile(tool_input, context)
            except TimeoutError:
                result = StillUnknown("lookup_timeout")
            except Exception as error:
                _log(
                    logging.WARNING,
                    "consumer.lookup_error",
                    f"consumer.lookup_error id={operation.display_id} error={type(error).__name__}",
                )
                result = StillUnknown("lookup_error")
            label = {Found: "committed", NotFound: "not_found", StillUnknown: "still_unknown"}[
                type(result)
            ]
            traced.set_attributes({"outbox.result": label})
            if isinstance(result, Found):
                traced.set_attributes({"outbox.provider_reference": result.provider_reference})
            if isinstance(result, StillUnknown):
                traced.set_attributes({"outbox.code": result.code})
            traced.set_status(not isinstance(result, StillUnknown), label)
        self.metrics.reconciliations.labels(contract.name, label).inc()
        try:
            async with self._transaction() as connection:
                runner = await AsyncStore.on(connection)
                await self._settle_lookup(runner, operation, contract, result)
        except IllegalTransition as fenced:
            _log(
                logging.WARNING,
                "consumer.write_fenced",
                f"consumer.write_fenced id={operation.display_id} reason={type(fenced).__name__}",
            )

    async def _settle_lookup(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        result: Reconciliation,
    ) -> None:
        token = operation.lease_token
        if isinstance(result, Found):
            await runner.run(
                store.transition(
                    operation.id,
                    source=S.OUTCOME_UNKNOWN,
                    target=S.COMMITTED,
                    lease_token=token,
                    event=EventName.RECONCILED,
                    attributes={"result": "committed", "method": "lookup"},
                    provider_reference=result.provider_reference,
                    result=dict(result.result),
                    reconcile_attempt=True,
                )
            )
        elif isinstance(result, NotFound):
            # Proven absent: the only road back to an attempt for a non-repeatable write.
            await runner.run(
                store.transition(
                    operation.id,
                    source=S.OUTCOME_UNKNOWN,
                    target=S.PREPARED,
                    lease_token=token,
                    event=EventName.RECONCILED,
                    attributes={"result": "not_found", "method": "lookup"},
                    reconcile_attempt=True,
                )
            )
        elif operation.reconcile_attempts + 1 >= contract.retry.reconcile_max_attempts:
            await self._escalate(
                runner,
                operation,
                contract,
                reason="reconcile_budget_exhausted",
                lookup_code=result.code,
            )
        else:
            await runner.run(
                store.defer_reconciliation(
                    operation.id,
                    lease_token=token,
                    reason=result.code,
                    delay=contract.retry.backoff(operation.reconcile_attempts + 1),
                )
            )


async def _suppressed(runner: AsyncStore, operation: Operation) -> _Skip:
    """A duplicate delivery, written down: the event is the durable count of what the
    dedupe stopped (metrics die with the process), and an operator reading the timeline
    sees the broker's redeliveries beside the one attempt."""
    await runner.run(
        store.append_event(
            operation, EventName.DELIVERY_SUPPRESSED, {"state": str(operation.state)}
        )
    )
    return _Skip("duplicate")


def _raised_at(error: BaseException) -> str:
    """File and line where an error was raised: a place in code, never the message, which
    may quote inputs."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown"
    last = frames[-1]
    return f"{os.path.basename(last.filename)}:{last.lineno}"


def _span_attributes(
    operation: Operation, contract: ToolContract[Any], fingerprint_key: str | None
) -> dict[str, tracing.AttributeValue]:
    # Ids, counters and the keyed short fingerprint only: never the tool input.
    attributes: dict[str, tracing.AttributeValue] = {
        "outbox.operation_id": str(operation.id),
        "outbox.tool": contract.name,
        "outbox.tool_version": contract.version,
        "outbox.attempt": operation.attempts,
    }
    if fingerprint_key is not None:
        attributes["outbox.fingerprint"] = keyed_fingerprint(
            fingerprint_key, operation.input_fingerprint
        )
    return attributes


def _unknown_outcome_policy(operation: Operation, contract: ToolContract[Any]) -> str:
    """DESIGN.md section 5, per side-effect class: 'reconcile', 'retry', or an
    escalation reason."""
    if contract.on_unknown is OnUnknown.ESCALATE:
        return "escalate_by_contract"
    if contract.reconcile is not None:
        if operation.reconcile_attempts >= contract.retry.reconcile_max_attempts:
            return "reconcile_budget_exhausted"
        return "reconcile"
    if operation.attempts >= contract.retry.max_attempts:
        return "retry_budget_exhausted"
    if contract.side_effect in (SideEffect.READ_ONLY, SideEffect.IDEMPOTENT_WRITE):
        return "retry"
    if contract.side_effect is SideEffect.DEDUPLICATED_WRITE:
        assert contract.dedupe_window is not None
        first = operation.first_attempt_at or operation.created_at
        # Replaying the key is safe only while the target still remembers it.
        if datetime.now(UTC) < first + contract.dedupe_window - contract.deadline:
            return "retry"
        return "dedupe_window_passed"
    return "no_reconcile"


def _safe_id(value: str | None) -> str:
    if value and len(value) <= 64 and value.replace("-", "").replace("_", "").isalnum():
        return value
    return "-"
