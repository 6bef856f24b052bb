"""The dispatcher: committed outbox rows to RabbitMQ, at least once, nothing lost.

One batch is one transaction: claim rows (``FOR UPDATE SKIP LOCKED``, by state), publish
them all with their confirms outstanding at once, mark the confirmed ones published and
push the failed ones back with a backoff, commit. A crash between publish and commit
publishes those rows again later; consumers deduplicate by operation id.

Wake-ups come from ``LISTEN outbox_pending`` (issued before the first scan, so nothing
committed after it is missed) with a polling fallback, since a notification sent while
nobody listens is lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from dispatcher.publisher import PUBLISH_FAILURE_REASONS, Publisher, PublishOutcome
from outbox import bounds, store
from outbox.backoff import exponential_delay
from outbox.broker import BrokerUnavailable, Topology
from outbox.connections import SLOW_VERDICTS, DatabaseBounds, LivenessProbe, deadline
from outbox.daemon import PEERS, Daemon, is_transient
from outbox.errors import OutboxError, TransientDatabaseError
from outbox.metrics import DispatcherMetrics, prime
from outbox.pacing import AIMDLimit
from outbox.settings import Settings, redact_url
from outbox.store import AsyncStore, FailedPublish

logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9464
APPLICATION_NAME = "outbox-dispatcher"
# The backlog, operations by state and queue depths: how often they are read.
GAUGE_REFRESH_SECONDS = 5.0
RETENTION_BATCH = 1000
RETENTION_INTERVAL_SECONDS = 60.0
# The gather waits only while the last this many decisions were notified within one
# gather window, i.e. while a wait takes at least two more into the batch: measured
# (docs/benchmarks.md, "2026-12-05, 15:10 to 15:22"), at 100 and 175 decisions/s a 10 ms
# wait gained a batch about one decision, for a p50 of 5.6 to 10.9 ms against 3.8 to 4.4
# without it; from 250/s, where three come within the window, it still saves the CPU.
GATHER_FROM_DECISIONS = 3


@dataclass(frozen=True)
class DrainReport:
    published: int
    failed: int


@dataclass
class _Tally:
    published: int = 0
    failed: int = 0


class Dispatcher(Daemon):
    name = "dispatcher"
    default_metrics_port = DEFAULT_METRICS_PORT

    def __init__(self, settings: Settings, metrics: DispatcherMetrics | None = None) -> None:
        super().__init__(settings, logger)
        self.metrics = metrics or DispatcherMetrics.create()
        prime(self.metrics.publish_failures, PUBLISH_FAILURE_REASONS)
        prime(self.metrics.reconnects, PEERS)
        self._topology = Topology.from_settings(settings)
        self._broker_session(False)
        # A batch's transaction stays open while its confirms are awaited.
        self.database_bounds = DatabaseBounds.from_settings(
            settings, held_open_for=settings.publish_timeout
        )
        prime(self.metrics.slow_transactions, SLOW_VERDICTS)
        # A batch past its soft deadline is cut only if its link is silent.
        self.probe = LivenessProbe(lambda: self._open_database(autocommit=True))
        self.on_lock_wait = self.lock_waits(self.metrics.lock_waits)
        # Backpressure against a slow broker or database: a batch that fails, or whose
        # confirms take half the publish timeout, halves the next batches.
        self.pacing = AIMDLimit(
            most=settings.batch_size,
            slow_after=settings.publish_timeout / 2,
            on_change=lambda limit: self.metrics.limit.labels("batch").set(limit),
        )
        self.metrics.limit.labels("batch").set(self.pacing.limit)
        self._server = self.server_tracker(self.metrics.database_failovers)
        self._wake = asyncio.Event()
        # When the latest decisions were notified: how close they come shows a burst.
        self._notified: collections.deque[float] = collections.deque(maxlen=GATHER_FROM_DECISIONS)
        self._healthy = False
        self._last_tick = 0.0

    # --- control ---------------------------------------------------------------------

    def healthy(self) -> bool:
        if not self._healthy:
            return False
        stale_after = self.settings.poll_interval * 3 + self.settings.publish_timeout + 5
        return asyncio.get_running_loop().time() - self._last_tick < stale_after

    # --- daemon ----------------------------------------------------------------------

    async def run(self) -> None:
        """Run until :meth:`stop`: serve metrics, dispatch, prune published rows."""
        try:
            await self._run()
        finally:
            await self.probe.close()

    async def _run(self) -> None:
        async with self.serving(
            self.metrics.registry,
            database=redact_url(self.settings.libpq_url),
            queue=self._topology.queue,
            message_operations=self.settings.message_operations,
            **self.database_bounds.fields(),
        ):
            beside = [
                asyncio.create_task(self._retention_loop()),
                asyncio.create_task(self._gauges_loop()),
            ]
            try:
                await self.keep_sessions(self._session, self._session_lost)
            finally:
                for task in beside:
                    task.cancel()
                for task in beside:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def drain(self) -> DrainReport:
        """Publish until no row is available, then return (``outbox dispatcher --once``)."""
        tally = _Tally()
        async with self._connections() as (databases, publisher):
            await self._drain_available(databases, publisher, tally)
        return DrainReport(published=tally.published, failed=tally.failed)

    def _session_lost(self, peer: str) -> None:
        self._healthy = False
        self._broker_session(False)
        self.metrics.reconnects.labels(peer).inc()

    def _broker_session(self, held: bool) -> None:
        """Whether a broker session is held; without one the queue depths are unknown."""
        self.metrics.broker_connected.set(1 if held else 0)
        if not held:
            for queue, _ in self._topology.depth_labels():
                self.metrics.queue_messages.labels(queue).set(math.nan)

    async def _session(self) -> None:
        async with (
            self._connections() as (databases, publisher),
            await self._connect_database(autocommit=True) as listener,
        ):
            await (await AsyncStore.on(listener, require_transaction=False)).run(
                store.listen_outbox_pending()
            )
            notifications = asyncio.create_task(self._forward_notifications(listener))
            # Beside the batches, never in their way: a broker that stalls a passive
            # declare must not hold up a publish (which has its own confirm timeout).
            depths = asyncio.create_task(self._queue_depths_loop(publisher))
            self._healthy = True
            self._broker_session(True)
            self.log(logging.INFO, "session_ready", "session ready")
            try:
                while not self.stopping:
                    self._last_tick = asyncio.get_running_loop().time()
                    self._wake.clear()
                    await self._drain_available(databases, publisher, _Tally())
                    await self._wait_for_work(notifications)
                    await self._gather()
            finally:
                depths.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await depths
                notifications.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    try:
                        await notifications
                    except Exception as error:
                        if not is_transient(error):
                            raise

    async def _drain_available(
        self,
        databases: list[psycopg.AsyncConnection[Any]],
        publisher: Publisher,
        tally: _Tally,
    ) -> None:
        """Drain with one lane, and start the next (one per connection) each time a lane
        finds a full batch. Lanes overlap one batch's database round trips with another's
        confirms; SKIP LOCKED keeps their batches apart, and each batch is still its own
        transaction. Woken for a row or two, only one lane claims: all of them at once
        cost one transaction each that found nothing (950 of 2,246 claims at 500/s)."""
        idle = list(databases)
        lanes: list[asyncio.Task[None]] = []

        def start_lane() -> None:
            if idle and not self.stopping:
                lane = self._drain_lane(idle.pop(0), publisher, tally, start_lane)
                lanes.append(asyncio.create_task(lane))

        start_lane()
        try:
            while running := [lane for lane in lanes if not lane.done()]:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for lane in lanes:
                    if lane.done():
                        lane.result()  # the first lane that failed ends the drain
        finally:
            for lane in lanes:
                lane.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)

    async def _drain_lane(
        self,
        database: psycopg.AsyncConnection[Any],
        publisher: Publisher,
        tally: _Tally,
        full_batch: Callable[[], None],
    ) -> None:
        while not self.stopping:
            limit = self.pacing.limit
            outcome = await self._batch(database, publisher, limit)
            if outcome is None:
                return
            tally.published += len(outcome.published)
            tally.failed += len(outcome.failed)
            if outcome.connection_lost:
                raise BrokerUnavailable("the broker connection failed during a batch")
            if len(outcome.published) + len(outcome.failed) < limit:
                return
            if not outcome.published:
                return  # a full batch that all failed: retrying now would fail the same way
            full_batch()  # more is waiting: another lane joins in

    async def _wait_for_work(self, notifications: asyncio.Task[None]) -> None:
        waiters = [
            asyncio.ensure_future(self._wake.wait()),
            asyncio.ensure_future(self.wait_for_stop()),
        ]
        try:
            await asyncio.wait(
                [*waiters, notifications],
                timeout=self.settings.poll_interval,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        if notifications.done():
            notifications.result()  # re-raise why the listener died
            raise TransientDatabaseError("the LISTEN connection ended")

    async def _gather(self) -> None:
        """Woken by a decision while decisions are coming in fast (the last
        :data:`GATHER_FROM_DECISIONS` were notified within ``dispatch_gather_ms``), wait
        that long before the claim: the decisions committed meanwhile join its batch, and
        a burst pays one claim, one publish and one mark, and the consumer one delivery,
        instead of one each. Decisions that come further apart are claimed at once: a
        wait would gain a batch about one decision, for its whole length on each
        decision's way. Nothing is waited after a poll's timeout (nothing was notified) or
        a stop."""
        gather = self.settings.dispatch_gather_ms / 1000
        if not gather or not self._wake.is_set() or self.stopping:
            return
        notified = self._notified
        now = asyncio.get_running_loop().time()
        if len(notified) == GATHER_FROM_DECISIONS and now - notified[0] < gather:
            await asyncio.sleep(gather)

    async def _forward_notifications(self, listener: psycopg.AsyncConnection[Any]) -> None:
        loop = asyncio.get_running_loop()
        async for _ in listener.notifies():
            self._notified.append(loop.time())
            self._wake.set()

    # --- one batch -------------------------------------------------------------------

    async def _batch(
        self, database: psycopg.AsyncConnection[Any], publisher: Publisher, limit: int
    ) -> PublishOutcome | None:
        """Claim at most ``limit`` rows, publish, mark, commit. None when nothing was
        available. A link that goes silent meanwhile costs the connection, never the
        rows: they stay claimable once the server ends the stalled session."""
        began = asyncio.get_running_loop().time()
        try:
            outcome = await self._publish_batch(database, publisher, limit)
        except Exception as error:
            if is_transient(error):
                self.pacing.overloaded()
            raise
        if outcome is not None and (outcome.failed or outcome.connection_lost):
            self.pacing.overloaded()
        elif outcome is not None:
            self.pacing.observe(asyncio.get_running_loop().time() - began)
        return outcome

    async def _publish_batch(
        self, database: psycopg.AsyncConnection[Any], publisher: Publisher, limit: int
    ) -> PublishOutcome | None:
        async with (
            deadline(
                database,
                self.database_bounds.transaction,
                hard=self.database_bounds.hard_transaction,
                probe=self.probe,
                on_slow=lambda verdict: self.metrics.slow_transactions.labels(verdict).inc(),
                on_lock_wait=self.on_lock_wait,
            ),
            database.transaction(),
        ):
            runner = await AsyncStore.on(database)
            rows = await runner.run(store.claim_outbox_batch(limit))
            if not rows:
                self.metrics.empty_claims.inc()
                return None
            started = asyncio.get_running_loop().time()
            outcome = await publisher.publish(rows, confirm_within=self.settings.publish_timeout)
            confirmed_after = asyncio.get_running_loop().time() - started
            await runner.run(store.mark_outbox_published([row.id for row in outcome.published]))
            await runner.run(
                store.mark_outbox_failed(
                    [
                        FailedPublish(
                            outbox_id=row.id,
                            error=text,
                            delay=self._retry_delay(row.publish_attempts + 1),
                        )
                        for row, _, text in outcome.failed
                    ]
                )
            )
        self.metrics.batch_size.observe(len(rows))
        # One labelled increment per tool, not per row: a label lookup takes the
        # counter's lock and costs about as much as the increment itself.
        per_tool: dict[str, int] = {}
        observe = self.metrics.commit_to_confirm.observe
        for row in outcome.published:
            per_tool[row.tool_name] = per_tool.get(row.tool_name, 0) + 1
            observe(row.waited_seconds + confirmed_after)
        for tool, count in per_tool.items():
            self.metrics.published.labels(tool).inc(count)
        if outcome.failed:
            reasons: dict[str, int] = {}
            for _, reason, _ in outcome.failed:
                reasons[reason] = reasons.get(reason, 0) + 1
            for reason, count in reasons.items():
                self.metrics.publish_failures.labels(reason).inc(count)
                self.log(
                    logging.WARNING, "publish_failed", "publish failed", reason=reason, rows=count
                )
        return outcome

    def _retry_delay(self, failed_attempts: int) -> timedelta:
        return timedelta(
            seconds=exponential_delay(
                failed_attempts,
                first=self.settings.publish_retry_initial,
                longest=self.settings.publish_retry_max,
            )
        )

    # --- housekeeping ----------------------------------------------------------------

    async def _queue_depths_loop(self, publisher: Publisher) -> None:
        """Read the queue depths every few seconds for as long as the session lasts. A
        failed read makes them unknown (NaN) until the next one; a lost broker is the
        batches' to find and the session's to end."""
        while not self.stopping:
            try:
                depths = await publisher.queue_depths()
            except Exception as error:
                depths = {queue: math.nan for queue, _ in self._topology.depth_labels()}
                self.log(
                    logging.WARNING if is_transient(error) else logging.ERROR,
                    "queue_depths_failed",
                    "reading the queue depths failed; the next turn retries",
                    error=type(error).__name__,
                )
            for queue, messages in depths.items():
                self.metrics.queue_messages.labels(queue).set(messages)
            await self._sleep(GAUGE_REFRESH_SECONDS)

    async def _gauges_loop(self) -> None:
        """Read the backlog and the operations by state every few seconds, on a database
        connection of their own: they stay true while the broker session is away, which
        is when the backlog grows. A failed read keeps the last values and a new
        connection is opened at the next turn; nothing ends the loop but the stop."""
        database: psycopg.AsyncConnection[Any] | None = None
        try:
            while not self.stopping:
                try:
                    if database is None or database.closed:
                        database = await self._open_database(autocommit=False)
                    await self.refresh_backlog(database)
                except Exception as error:
                    if database is not None:
                        await database.close()
                        database = None
                    expected = isinstance(error, OutboxError) or is_transient(error)
                    self.log(
                        logging.WARNING if expected else logging.ERROR,
                        "gauges_failed",
                        "reading the backlog gauges failed; the next turn retries",
                        error=type(error).__name__,
                    )
                await self._sleep(GAUGE_REFRESH_SECONDS)
        finally:
            if database is not None:
                await database.close()

    async def refresh_backlog(self, database: psycopg.AsyncConnection[Any]) -> store.Backlog:
        async with deadline(database, self.database_bounds.transaction), database.transaction():
            runner = await AsyncStore.on(database)
            backlog = await runner.run(store.outbox_backlog())
            by_state = await runner.run(store.operations_by_state())
        self.metrics.backlog.set(backlog.pending)
        self.metrics.oldest_pending_age.set(backlog.oldest_age_seconds)
        for state, count in by_state.items():
            self.metrics.operations.labels(str(state)).set(count)
        return backlog

    async def prune(self) -> int:
        """Delete rows published longer ago than the retention, in small transactions."""
        deleted = 0
        async with await self._connect_database() as database:
            while not self.stopping:
                async with (
                    deadline(database, self.database_bounds.transaction),
                    database.transaction(),
                ):
                    batch = await (await AsyncStore.on(database)).run(
                        store.delete_published_outbox_rows(self.settings.retention, RETENTION_BATCH)
                    )
                deleted += batch
                if batch < RETENTION_BATCH:
                    break
        if deleted:
            self.metrics.retention_deleted.inc(deleted)
            self.log(logging.INFO, "pruned", "pruned published rows", rows=deleted)
        return deleted

    async def _retention_loop(self) -> None:
        while not self.stopping:
            try:
                await self.prune()
            except Exception as error:
                if not is_transient(error):
                    raise
                self.log(
                    logging.WARNING, "prune_failed", "pruning failed", error=type(error).__name__
                )
            await self._sleep(RETENTION_INTERVAL_SECONDS)

    # --- connections -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _connections(
        self,
    ) -> AsyncIterator[tuple[list[psycopg.AsyncConnection[Any]], Publisher]]:
        """One database connection per lane, and the broker."""
        publisher = Publisher(
            self.settings.amqp_url.get_secret_value(),
            self.settings.amqp_heartbeat,
            self._topology,
            connection_name=f"{APPLICATION_NAME} {self.worker_id}",
            declare_topology=self.settings.declare_topology,
            operations_per_message=self.settings.message_operations,
        )
        async with contextlib.AsyncExitStack() as stack:
            databases = [
                await stack.enter_async_context(await self._connect_database())
                for _ in range(self.settings.dispatch_lanes)
            ]
            stack.push_async_callback(publisher.close)
            await self.connect_with_retry(publisher.connect, "broker")
            yield databases, publisher

    async def _connect_database(self, *, autocommit: bool = False) -> psycopg.AsyncConnection[Any]:
        async def connect() -> psycopg.AsyncConnection[Any]:
            return await self._open_database(autocommit=autocommit)

        return await self.connect_with_retry(connect, "database")

    async def _open_database(self, *, autocommit: bool) -> psycopg.AsyncConnection[Any]:
        connection = await psycopg.AsyncConnection.connect(
            self.settings.libpq_url,
            autocommit=autocommit,
            application_name=APPLICATION_NAME,
            **self.database_bounds.libpq_parameters(),
        )
        bounds.bind(connection)
        self._server.observe(connection)
        return connection
