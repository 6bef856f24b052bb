"""The providers' health as one consumer sees it: whether a call may go out now, and
what a call that got no answer does to its provider's breaker.

The verdict lives in Postgres (``provider_health``, decided by :mod:`outbox.breaker`), so
every consumer and reconciler holds the same one; each process keeps a copy it trusts
for ``provider_health_refresh`` seconds, so the hot path asks nothing of the database
while every provider is healthy. Writes go to the database at once: a failure (which
may open the breaker), the answer that closes it (which releases the operations that
waited, spread over ``provider_release_spread``), and the probe of an open one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from consumer.database import Database
from consumer.policy import ProviderWait
from consumer.telemetry import log, log_refresh_failed
from outbox import breaker, store
from outbox.breaker import BreakerRules, Failure, Go, Hold, Probe, ProviderHealth
from outbox.contracts import Registry, ToolContract
from outbox.daemon import is_transient_database_error
from outbox.errors import OutboxError
from outbox.metrics import ConsumerMetrics
from outbox.models import Operation
from outbox.settings import Settings
from outbox.signals import Stoppable
from outbox.store import Plan

# How far ahead a declared rate's turns may be booked: past it, a call books nothing and
# tries again later, so a deep backlog waits in the broker, not as bookings.
BOOKING_HORIZON = timedelta(seconds=20)
BOOKING_RETRY = BOOKING_HORIZON / 4
# How long past its call's deadline a probe is held before another may take it over.
PROBE_MARGIN = timedelta(seconds=2)
# How old a copy of the breakers may be when it holds an operation back.
FRESH_ENOUGH = 0.1


class Providers(Stoppable):
    """The breakers of the providers this consumer's tools call. :meth:`run` keeps the
    copy fresh on a loop of its own, so that neither the claims nor the reconciler wait
    on a read of it."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        metrics: ConsumerMetrics,
        database: Database,
        *,
        worker_id: str,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.metrics = metrics
        self.database = database
        self.worker_id = worker_id
        longest = timedelta(seconds=settings.provider_longest_probe)
        self.rules = BreakerRules(
            failures_to_open=settings.provider_failures_to_open,
            window=timedelta(seconds=settings.provider_failure_window),
            first_probe=min(timedelta(seconds=1), longest),
            longest_probe=longest,
        )
        self.release_spread = timedelta(seconds=settings.provider_release_spread)
        self.tools: dict[str, list[str]] = {}
        for contract in registry:
            self.tools.setdefault(contract.provider_name, []).append(contract.name)
        # Jitter only: nothing here is secret or needs to be unpredictable.
        self._rng = rng or random.Random()  # noqa: S311
        self._health: dict[str, ProviderHealth] = {}
        # The database's clock minus this process's when the copy was read: verdicts
        # compare the database's times with the database's clock.
        self._skew = timedelta(0)
        self._read_at = float("-inf")
        for provider in self.tools:
            metrics.provider_available.labels(provider).set(1)
            metrics.provider_waiting.labels(provider).set(0)
            metrics.provider_outages.labels(provider)

    def now(self) -> datetime:
        """The database's clock, as well as this process can tell it."""
        return datetime.now(UTC) + self._skew

    async def refresh(self, *, force: bool = False) -> None:
        """Read the breakers again if the copy is older than ``provider_health_refresh``."""
        if not force and time.monotonic() - self._read_at < self.settings.provider_health_refresh:
            return
        health, now = await self.database.run_alone(store.provider_health(list(self.tools)))
        self._remember(health.values(), now)

    async def run(self) -> None:
        """Refresh the copy every ``provider_health_refresh`` until :meth:`stop`. A failed
        read keeps the last copy (a database that is away is what the deliveries' own
        retries show) and is tried again at the next turn."""
        while not self.stopping:
            try:
                await self.refresh(force=True)
            except Exception as error:
                log_refresh_failed(
                    error,
                    "consumer.providers_failed",
                    "reading the providers' breakers failed; the next turn retries",
                )
            await self._sleep(self.settings.provider_health_refresh)

    def _remember(self, rows: Iterable[ProviderHealth], now: datetime) -> None:
        self._read_at = time.monotonic()
        self._skew = now - datetime.now(UTC)
        fresh = {row.provider: row for row in rows}
        self._health = fresh
        for provider in self.tools:
            row = fresh.get(provider)
            self.metrics.provider_available.labels(provider).set(
                1 if row is None or row.available else 0
            )

    def _keep(self, row: ProviderHealth) -> None:
        self._health[row.provider] = row
        self.metrics.provider_available.labels(row.provider).set(1 if row.available else 0)

    def verdict(self, provider: str) -> Go | Probe | Hold:
        """Whether a call to ``provider`` may go out now, by this process's copy."""
        return breaker.verdict(self._health.get(provider), now=self.now())

    async def fresh_verdict(self, provider: str) -> Go | Probe | Hold:
        """:meth:`verdict`, by a copy read at most :data:`FRESH_ENOUGH` ago: asked before
        an operation is held back, so that one released when its provider came back is
        not held again by a copy that has not heard it yet."""
        if time.monotonic() - self._read_at > FRESH_ENOUGH:
            await self.refresh(force=True)
        return self.verdict(provider)

    async def nominate_probes(self) -> int:
        """For each provider whose probe is due by the copy, make one of its waiting
        operations due now: it takes the probe when it comes (the others wait on, to
        be released when the provider is back). Returns how many were nominated."""
        nominated = 0
        for provider, tools in self.tools.items():
            if not isinstance(self.verdict(provider), Probe):
                continue
            if await self.database.run_alone(store.nominate_probe(tools)) is not None:
                nominated += 1
        return nominated

    async def take_probe(
        self, provider: str, operation_id: UUID, deadline: timedelta
    ) -> str | None:
        """The probe of ``provider``'s open breaker, for the call of ``operation_id`` whose
        tool's deadline is ``deadline``: its token if this process won it, None if another
        holds it or none is due. The probe is held for the call's deadline and
        :data:`PROBE_MARGIN`, not for the operation's lease: a prober that dies leaves the
        provider unprobed only that long, and two probes at once cost one call more."""
        lease = deadline + PROBE_MARGIN
        owner = f"{self.worker_id}/{operation_id}"[:200]
        taken = await self.database.run(
            store.take_provider_probe(provider, owner=owner, lease=lease)
        )
        if taken is None:
            await self.refresh(force=True)
            return None
        self._keep(taken)
        log(
            logging.INFO,
            "provider.probe",
            "one call goes out to see whether the provider is back",
            provider=provider,
            probe=taken.probes,
        )
        return owner

    async def failed(self, provider: str, failure: Failure) -> ProviderHealth:
        """A call of ``provider`` that got no answer (or a rate limit): written at once;
        returns the breaker as it now stands."""
        change = await self.database.run(
            store.record_provider_failure(provider, failure, rules=self.rules, rng=self._rng)
        )
        self._keep(change.after)
        self._skew = change.now - datetime.now(UTC)
        if change.opened:
            self.metrics.provider_outages.labels(provider).inc()
            log(
                logging.WARNING,
                "provider.unavailable",
                "calls to the provider get no answer; its operations wait",
                provider=provider,
                operations=len(change.after.failing_operations),
                last_failure=failure.code,
            )
        return change.after

    async def answered(self, provider: str) -> None:
        """The provider answered a call (any answer): written only when the copy shows
        an open breaker or a streak to forget."""
        known = self._health.get(provider)
        if known is None or known.clean:
            return
        change = await self.database.run(
            store.record_provider_answer(
                provider, tools=self.tools.get(provider, []), release_spread=self.release_spread
            )
        )
        if change is None:
            return
        self._keep(change.after)
        if change.closed:
            before = change.before
            started = before.outage_started_at or change.now
            log(
                logging.WARNING,
                "provider.available",
                "the provider answers again; the operations that waited are released",
                provider=provider,
                outage_seconds=round((change.now - started).total_seconds(), 3),
                probes=before.probes,
            )

    async def turn(self, contract: ToolContract[Any], *, force: bool = False) -> float | None:
        """Seconds until this call's turn under its provider's declared rate (0 without
        limits, or within the burst), or None when its turn would be further off than
        :data:`BOOKING_HORIZON`: nothing is booked then, and the caller asks again after
        :data:`BOOKING_RETRY`, so a deep backlog waits in the broker, not as bookings.
        Turns are booked in Postgres: every consumer and the reconciler share one rate.
        ``force`` books a turn however far off it is."""
        limits = contract.provider_limits
        if limits is None or limits.interval is None:
            return 0.0
        return await self.database.run(
            store.book_provider_call(
                contract.provider_name,
                interval=limits.interval,
                burst=limits.burst,
                horizon=timedelta(days=1) if force else BOOKING_HORIZON,
            )
        )

    def confirmed(self, wait: ProviderWait) -> Plan[ProviderWait]:
        """``wait``, checked under a share lock on its provider's row in the transaction
        that writes it: if the breaker that held the operation back has closed since
        this process's copy was read, the operation is due again within the release
        spread (as the closing answer's release would have made it), not after the
        next probe. Part of the writing transaction's plan, so that the wait and the
        closing release cannot pass each other."""
        if wait.outage is None:
            return wait
        unavailable = yield from store.provider_still_unavailable(wait.provider)
        if unavailable:
            return wait
        released = timedelta(seconds=self._rng.random() * self.release_spread.total_seconds())
        return replace(wait, delay=max(released, timedelta(milliseconds=50)), outage=None)

    async def take_place(self, contract: ToolContract[Any], operation_id: UUID) -> float | None:
        """A place among the calls out to the provider, if it declares how many it takes
        at once: None when this call has one (or there is no such limit), otherwise the
        seconds until a place may free up (the soonest call out ends by then at the
        latest; ask again after at most a second, since most end sooner)."""
        limits = contract.provider_limits
        if limits is None or limits.concurrent_calls is None:
            return None
        soonest = await self.database.run(
            store.take_provider_call(
                contract.provider_name,
                operation_id,
                limit=limits.concurrent_calls,
                hold=contract.deadline + timedelta(seconds=self.settings.lease_margin),
            )
        )
        if soonest is None:
            return None
        return min(max((soonest - self.now()).total_seconds(), 0.05), 1.0)

    async def give_back_place(self, contract: ToolContract[Any], operation_id: UUID) -> None:
        """The call is over: its place goes to the next one. A place that cannot be given
        back now (the database is away) is freed when it expires."""
        limits = contract.provider_limits
        if limits is None or limits.concurrent_calls is None:
            return
        try:
            await self.database.run_alone(
                store.give_back_provider_call(contract.provider_name, operation_id)
            )
        except Exception as error:
            if not (isinstance(error, OutboxError) or is_transient_database_error(error)):
                raise
            log(
                logging.WARNING,
                "consumer.place_kept",
                "a call's place could not be given back; it frees when it expires",
                provider=contract.provider_name,
                error=type(error).__name__,
            )

    def wait(
        self,
        contract: ToolContract[Any],
        operation: Operation,
        *,
        retry_after: timedelta | None = None,
    ) -> ProviderWait:
        """How long ``operation`` waits before its provider is asked again, and how long
        it has waited so far.

        Held by an open breaker, it comes back after the breaker's next probe and then
        some (the answer that closes the breaker releases it sooner); held by nothing
        but its own call's failure, after a pause that grows with the wait, within the
        contract's backoff bounds. Never past the contract's outage tolerance, when a
        person is asked, and never before a Retry-After."""
        provider = contract.provider_name
        now = self.now()
        waited = now - operation.waiting_since if operation.waiting_since else timedelta(0)
        waited = max(waited, timedelta(0))
        verdict = self.verdict(provider)
        policy = contract.retry
        outage: ProviderHealth | None = None
        if isinstance(verdict, Hold) and verdict.outage is not None:
            outage = verdict.outage
            spread = self.rules.longest_probe.total_seconds() * (1 + self._rng.random())
            delay = max(verdict.until - now, timedelta(0)) + timedelta(seconds=spread)
        else:
            grown = min(max(waited / 2, policy.initial_backoff), policy.max_backoff)
            delay = grown * (1 + policy.jitter * self._rng.random())
            if isinstance(verdict, Hold):
                delay = max(delay, verdict.until - now)
        if retry_after is not None:
            delay = max(delay, retry_after)
        left = contract.outage_tolerance - waited
        if left > timedelta(0):
            # Back just after the tolerance runs out, to hand it to a person then.
            delay = min(delay, left + timedelta(milliseconds=100))
        return ProviderWait(provider, max(delay, timedelta(milliseconds=50)), waited, outage)
