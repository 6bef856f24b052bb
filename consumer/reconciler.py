"""The reconciler: settles what no delivery will.

It looks up every unknown outcome before anything else may happen to it, and takes over
operations whose worker died holding the lease: an expired lease means *outcome
unknown*, not "retry". Every few passes it also sweeps prepared operations that no
message reaches any more. It runs as a loop beside the consumer's deliveries, in the
same process; what it decides comes from :mod:`consumer.policy`.

Under overload it gets slower, never louder: one pass at a time (reconciling and
sweeping share one loop), a failed pass waits an exponential, jittered backoff before
the next, and the batch a pass takes narrows when passes fail and widens again when
they succeed (:class:`~outbox.pacing.AIMDLimit`, exported as
``outbox_consumer_limit{limit="reconcile_batch"}``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import traceback
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from consumer import policy
from consumer.callback_decisions import contradicted_lookup
from consumer.callbacks import Applied, Callbacks, success_reported
from consumer.database import Database, quarantine_unreadable, transition_plan
from consumer.policy import Deferral, Escalation, LookUp, Transition
from consumer.providers import BOOKING_RETRY, Providers
from consumer.telemetry import log, log_fenced, observe_outcome, span_attributes
from outbox import store, tracing
from outbox.backoff import Backoff, jittered
from outbox.bounds import is_unreadable
from outbox.breaker import Failure, Go, Hold, Probe, could_not_reach
from outbox.contracts import Registry, ToolContract
from outbox.daemon import is_transient_database_error
from outbox.errors import DatabaseError, IllegalTransition, OutboxError, ToolNotRegistered
from outbox.metrics import ConsumerMetrics
from outbox.models import Callback, Operation
from outbox.outcomes import (
    ExecutionContext,
    Found,
    NotFound,
    Reconciliation,
    StillUnknown,
    Unreachable,
)
from outbox.pacing import AIMDLimit
from outbox.settings import Settings
from outbox.signals import Stoppable
from outbox.states import OperationState
from outbox.store import AsyncStore

S = OperationState

STALE_SWEEP_SECONDS = 30.0
# The code of a lookup that raised instead of answering.
LOOKUP_ERROR = "lookup_error"
RECONCILER_BACKOFF_SECONDS = 1.0
# A failed pass waits 1 s doubling to 30 s (jittered) before the next: a struggling
# database is not asked again at the reconcile interval by every consumer at once.
RECONCILER_LONGEST_BACKOFF_SECONDS = 30.0


class Reconciler(Stoppable):
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        metrics: ConsumerMetrics,
        database: Database,
        *,
        worker_id: str,
        providers: Providers | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.registry = registry
        self.metrics = metrics
        self.database = database
        self.worker_id = worker_id
        self.providers = providers or Providers(
            settings, registry, metrics, database, worker_id=worker_id
        )
        self.callbacks = Callbacks(registry, metrics, database, batch=settings.reconcile_batch)
        self._report_refusal_said_at = -math.inf
        self.pacing = AIMDLimit(
            most=settings.reconcile_batch,
            on_change=lambda limit: metrics.limit.labels("reconcile_batch").set(limit),
        )
        metrics.limit.labels("reconcile_batch").set(self.pacing.limit)
        self.backoff = Backoff(
            first=RECONCILER_BACKOFF_SECONDS, longest=RECONCILER_LONGEST_BACKOFF_SECONDS
        )

    async def run(self) -> None:
        """Reconcile and sweep until :meth:`stop`, outliving any failed pass; one pass
        at a time, with a jittered backoff after each failed one."""
        next_sweep = 0.0
        while not self.stopping:
            try:
                if time.monotonic() >= next_sweep:
                    # Jittered: consumers started together do not sweep in lockstep.
                    next_sweep = time.monotonic() + jittered(self._stale_sweep_seconds)
                    await self.requeue_stale()
                busy = await self.reconcile_once()
                self.pacing.succeeded()
                self.backoff.reset()
            except Exception as error:
                busy = 0
                self.pacing.overloaded()
                if isinstance(error, OutboxError) or is_transient_database_error(error):
                    # The loop outlives any one failure: it is what settles unknown outcomes.
                    delay = self.backoff.next_delay()
                    log(
                        logging.WARNING,
                        "consumer.reconcile_failed",
                        "a reconciler pass failed; the next one retries after a backoff",
                        error=type(error).__name__,
                        retry_in=round(delay, 2),
                        batch=self.pacing.limit,
                    )
                    await self._sleep(delay)
                else:
                    # Nor an unforeseen one: a reconciler that died while this process
                    # goes on consuming would leave expired leases and unknown outcomes
                    # unsettled with nothing to show for it. Loudly, then after a pause.
                    log(
                        logging.ERROR,
                        "consumer.reconcile_crashed",
                        "the reconciler crashed; it starts again after a pause",
                        error=type(error).__name__,
                        where=_raised_at(error),
                    )
                    await self._sleep(RECONCILER_BACKOFF_SECONDS)
            if not busy:
                await self._sleep(self.settings.reconcile_interval)

    @property
    def _stale_sweep_seconds(self) -> float:
        # Twice per requeue period at least, so a stale operation waits at most 1.5x it.
        return min(STALE_SWEEP_SECONDS, self.settings.requeue_stale_after.total_seconds() / 2)

    async def requeue_stale(self) -> list[UUID]:
        """Queue again prepared operations that no message has reached for
        ``requeue_stale_after`` (their message was dead-lettered or lost); escalate those
        queued again too often already; end as rejected those whose approval was denied
        and never granted. Nothing prepared waits forever. Returns the requeued ids."""
        settings = self.settings
        batch = self.pacing.limit
        escalated = await self.database.run(
            store.escalate_undeliverable(
                settings.requeue_stale_after, settings.undeliverable_after_requeues, batch
            )
        )
        requeued = await self.database.run(
            store.requeue_stale_prepared(settings.requeue_stale_after, batch)
        )
        rejected = await self.database.run(
            store.reject_denied_operations(settings.approval_denial_grace, batch)
        )
        for _, tool in escalated:
            self.metrics.escalations.labels(tool, "undeliverable").inc()
        for count, action in (
            (len(escalated), "escalated_undeliverable"),
            (len(requeued), "requeued_stale"),
            (len(rejected), "rejected_denied"),
        ):
            if count:
                log(
                    logging.WARNING,
                    f"consumer.{action}",
                    action.replace("_", " "),
                    operations=count,
                )
        return requeued

    async def reconcile_once(self) -> int:
        """One pass: the callbacks inbox, the agents' reports, then unknown outcomes and
        expired leases; returns how many callbacks, reports and operations it took up."""
        applied_first = await self.callbacks.apply_pending()
        chained = await self._chain_agent_reports()
        # At most once per provider_health_refresh: a reconciler run on its own (without
        # the consumer's loop) still sees the breakers.
        await self.providers.refresh()
        await self.providers.nominate_probes()
        lookups: list[tuple[Operation, ToolContract[Any], str | None]] = []
        applied = Applied()
        async with self.database.transaction() as connection:
            runner = await AsyncStore.on(connection)
            await self.database.remember_fingerprint_key(runner)
            candidates = await runner.run(store.claim_reconciliation_batch(self.pacing.limit))
            # Read after the rows were locked: a callback committed before is decided
            # with, one being recorded kept its operation out of this batch (for its
            # first 10 s due), one committed from here on is applied to what this writes.
            callbacks = await self.callbacks.pending_of(runner, candidates) if candidates else {}
            for operation in candidates:
                try:
                    contract = self.registry.get(operation.tool_name, operation.tool_version)
                except ToolNotRegistered:
                    continue  # a consumer that has the tool will take it
                leased = await self._triage(
                    runner, operation, contract, callbacks.get(operation.id, []), applied
                )
                if leased is not None:
                    lookups.append((leased[0], contract, leased[1]))
        applied.count(self.metrics)
        if lookups:
            await asyncio.gather(*(self._look_up(*lookup) for lookup in lookups))
        return applied_first + chained + len(candidates)

    async def _chain_agent_reports(self) -> int:
        """Move the agents' committed reports into their chains, in a transaction of its
        own: the heads it locks are held for one statement, never for an agent's
        transaction. A refusal (a database migrated without `outbox migrate --roles`
        since version 10, whose consumer may not run the function) is said, once a
        minute at most, and costs the pass nothing else: reports wait, unknown outcomes
        do not."""
        try:
            return await self.database.run_alone(store.chain_agent_reports(self.pacing.limit))
        except DatabaseError as error:
            if is_transient_database_error(error):
                raise
            if time.monotonic() >= self._report_refusal_said_at + 60:
                self._report_refusal_said_at = time.monotonic()
                log(
                    logging.ERROR,
                    "consumer.agent_reports_refused",
                    "the agents' reports could not be chained; run outbox migrate --roles",
                    error=type(error).__name__,
                )
            return 0

    async def _triage(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        callbacks: list[Callback],
        applied: Applied,
    ) -> tuple[Operation, str | None] | None:
        """Settle what the policy can without a lookup, the operation's callbacks first;
        returns the operation leased for a lookup if it needs one (with the provider
        probe the lookup is, if it is one). A lookup its provider holds back (an open
        breaker, a Retry-After) waits instead, spending nothing, or goes to a person past
        the contract's outage tolerance."""
        if operation.state is S.IN_FLIGHT:
            operation = await runner.run(
                transition_plan(operation, policy.after_lease_expired(operation))
            )
        operation = await self.callbacks.settle(runner, operation, callbacks, applied)
        if operation.state is not S.OUTCOME_UNKNOWN:
            return None  # a callback settled it, sent it back, or handed it to a person
        if is_unreadable(operation.input) and operation.state is S.OUTCOME_UNKNOWN:
            # A lookup needs the input the effect was attempted with.
            await quarantine_unreadable(runner, self.metrics, operation, contract.name)
            return None
        decision = policy.for_unknown_outcome(operation, contract, now=datetime.now(UTC))
        if isinstance(decision, LookUp):
            lease = contract.deadline + timedelta(seconds=self.settings.lease_margin)
            provider = contract.provider_name
            verdict = self.providers.verdict(provider)
            if not isinstance(verdict, Go):
                verdict = await self.providers.fresh_verdict(provider)
            probe = None
            if isinstance(verdict, Probe):
                probe = await self.providers.take_probe(provider, operation.id, contract.deadline)
                if probe is None:
                    verdict = self.providers.verdict(provider)
            if probe is None and not isinstance(verdict, Go):
                reason = (
                    "provider_unavailable"
                    if not isinstance(verdict, Hold) or (verdict.outage is not None)
                    else "retry_after"
                )
                await self._hold(runner, operation, contract, reason)
                return None
            leased = await runner.run(
                store.lease_for_reconciliation(operation, owner=self.worker_id, lease=lease)
            )
            return None if leased is None else (leased, probe)
        await self._apply(runner, operation, contract, decision)
        return None

    async def _await_turn(self, operation: Operation, contract: ToolContract[Any]) -> bool:
        """Wait for the lookup's turn under its provider's declared rate, if the lease
        leaves room for the wait, and take a place among its calls out; otherwise put the
        lookup off until about then (no lookup counted, no wait for the provider begun)
        and return False. A place taken is given back by the caller."""
        wait = await self.providers.turn(contract)
        if wait is not None and wait <= self.settings.lease_margin / 2:
            if wait > 0:
                await asyncio.sleep(wait)
            place = await self.providers.take_place(contract, operation.id)
            if place is None:
                return True
            # Every place is taken: ask again about when the soonest frees up.
            delay = timedelta(seconds=place)
        else:
            delay = timedelta(seconds=wait) if wait is not None else BOOKING_RETRY
        try:
            async with self.database.transaction() as connection:
                runner = await AsyncStore.on(connection)
                await runner.run(
                    store.wait_unknown(
                        operation,
                        delay=delay,
                        provider=contract.provider_name,
                        reason="paced",
                        waiting=False,
                    )
                )
        except IllegalTransition:
            pass  # another process took it over; it will ask in its own turn
        return False

    async def _hold(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        reason: str,
        retry_after: timedelta | None = None,
    ) -> None:
        """An unknown outcome whose provider cannot be asked now: looked up again later,
        no lookup counted, or handed to a person once it has waited past the contract's
        outage tolerance."""
        held_by = self.providers.wait(contract, operation, retry_after=retry_after)
        wait = await runner.run(self.providers.confirmed(held_by))
        # A breaker that closed meanwhile releases it, past the tolerance or not.
        closed_meanwhile = held_by.outage is not None and wait.outage is None
        if wait.waited >= contract.outage_tolerance and not closed_meanwhile:
            decision = policy.provider_unavailable(
                operation, contract, wait, source=S.OUTCOME_UNKNOWN
            )
            await runner.run(transition_plan(operation, decision.transition))
            self.metrics.escalations.labels(contract.name, str(decision.reason)).inc()
            return
        await runner.run(
            store.wait_unknown(operation, delay=wait.delay, provider=wait.provider, reason=reason)
        )

    async def _apply(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        decision: Transition | Escalation | Deferral,
    ) -> Operation | None:
        """Write ``decision``; returns where a transition left the operation."""
        if isinstance(decision, Deferral):
            await runner.run(
                store.defer_reconciliation(
                    operation.id,
                    lease_token=operation.lease_token,
                    reason=decision.code,
                    delay=decision.delay,
                )
            )
        elif isinstance(decision, Escalation):
            await runner.run(transition_plan(operation, decision.transition))
            self.metrics.escalations.labels(contract.name, str(decision.reason)).inc()
        else:
            return await runner.run(transition_plan(operation, decision))
        return None

    async def _look_up(
        self, operation: Operation, contract: ToolContract[Any], probe: str | None = None
    ) -> None:
        """Ask the provider under the reconciler's lease, then write what the answer
        allows in a transaction of its own. A lookup that could not ask (Unreachable,
        or an inconclusive one whose code says no answer came) costs none of the
        contract's lookups: the operation waits for its provider."""
        assert contract.reconcile is not None
        if not await self._await_turn(operation, contract):
            return
        try:
            await self._ask(operation, contract, probe)
        finally:
            await self.providers.give_back_place(contract, operation.id)

    async def _ask(
        self, operation: Operation, contract: ToolContract[Any], probe: str | None
    ) -> None:
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
                **span_attributes(operation, contract, self.database.fingerprint_key),
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
                log(
                    logging.WARNING,
                    "consumer.lookup_error",
                    "the lookup raised; the outcome stays unknown",
                    id=operation.display_id,
                    error=type(error).__name__,
                )
                result = StillUnknown(LOOKUP_ERROR)
            label = {
                Found: "committed",
                NotFound: "not_found",
                StillUnknown: "still_unknown",
                Unreachable: "unreachable",
            }[type(result)]
            traced.set_attributes({"outbox.result": label})
            if isinstance(result, Found):
                traced.set_attributes({"outbox.provider_reference": result.provider_reference})
            if isinstance(result, StillUnknown | Unreachable):
                traced.set_attributes({"outbox.code": result.code})
            traced.set_status(not isinstance(result, StillUnknown | Unreachable), label)
        unreached = isinstance(result, Unreachable) or (
            isinstance(result, StillUnknown) and could_not_reach(result.code)
        )
        if unreached:
            label = "unreachable"
        self.metrics.reconciliations.labels(contract.name, label).inc()
        provider = contract.provider_name
        if unreached:
            assert isinstance(result, StillUnknown | Unreachable)
            retry_after = result.retry_after if isinstance(result, Unreachable) else None
            await self.providers.failed(
                provider, Failure(operation.id, result.code, retry_after=retry_after, prober=probe)
            )
            try:
                async with self.database.transaction() as connection:
                    runner = await AsyncStore.on(connection)
                    await self._hold(runner, operation, contract, result.code, retry_after)
            except IllegalTransition as fenced:
                log_fenced(operation, fenced)
            return
        if not (isinstance(result, StillUnknown) and result.code == LOOKUP_ERROR):
            # The provider answered; a lookup that raised says nothing of it.
            await self.providers.answered(provider)
        decision: Transition | Escalation | Deferral | None = policy.after_lookup(
            operation, contract, result
        )
        applied = Applied()
        try:
            async with self.database.transaction() as connection:
                runner = await AsyncStore.on(connection)
                if isinstance(result, NotFound) and contract.callbacks is not None:
                    # Proof of absence, unless the provider reported the effect done.
                    success = await self._reported_success(runner, operation, contract)
                    if success is not None:
                        await self.callbacks.write(
                            runner,
                            operation,
                            contract,
                            success,
                            contradicted_lookup(operation, success),
                            applied,
                        )
                        decision = None
                moved = None
                if decision is not None:
                    moved = await self._apply(runner, operation, contract, decision)
        except IllegalTransition as fenced:
            log_fenced(operation, fenced)
            return
        applied.count(self.metrics)
        if moved is not None:
            observe_outcome(self.metrics, moved)

    async def _reported_success(
        self, runner: AsyncStore, operation: Operation, contract: ToolContract[Any]
    ) -> Callback | None:
        """A success callback of the contract's provider for ``operation``, read after its
        row is locked: one committed from here on is applied to what this decides."""
        await runner.run(store.lock_operation(operation.id))
        callbacks = (await runner.run(store.callbacks_of([operation.id]))).get(operation.id, [])
        for callback in callbacks:
            if success_reported([callback], contract, but=-1):
                return callback
        return None


def _raised_at(error: BaseException) -> str:
    """File and line where an error was raised: a place in code, never the message, which
    may quote inputs."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "unknown"
    last = frames[-1]
    return f"{os.path.basename(last.filename)}:{last.lineno}"
