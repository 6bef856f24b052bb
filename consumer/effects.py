"""Claims to effects: call the tool once under the claim's lease and deadline, then
record where :func:`consumer.policy.after_attempt` says the outcome leads, under the
claim's fencing token. Confirmed effects that finish in the same burst share one
transaction (group commit)."""

from __future__ import annotations

import asyncio
import logging
import time

from consumer import policy
from consumer.batching import Batcher
from consumer.claims import Claimed
from consumer.database import Database, transition_plan
from consumer.policy import LEASE_LOST_BEFORE_CALL, Attempt, AttemptOutcome
from consumer.telemetry import log, observe_outcome, span_attributes
from outbox import store, tracing
from outbox.errors import IllegalTransition
from outbox.metrics import ConsumerMetrics
from outbox.outcomes import DefinitiveRejection, ExecutionContext, NotSent, OutcomeUnknown
from outbox.settings import Settings


class Effects:
    """The call and its record, for one consumer."""

    def __init__(self, settings: Settings, metrics: ConsumerMetrics, database: Database) -> None:
        self.settings = settings
        self.metrics = metrics
        self.database = database
        self._commits = Batcher(self._record_many, limit=lambda: database.pacing.limit)

    async def attempt(self, claimed: Claimed, traceparent: str | None = None) -> Attempt:
        """Call the tool once for ``claimed``, in a span that continues the decision's
        trace; never raises, whatever the tool does."""
        operation, contract = claimed.operation, claimed.contract
        with tracing.span(
            f"outbox.attempt {contract.name}",
            parent_traceparent=traceparent,
            attributes=(
                span_attributes(operation, contract, self.database.fingerprint_key)
                if tracing.active()
                else {}
            ),
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
        # One statement writes every row and its event: autocommit spares two round trips.
        committed = await self.database.run_alone(store.commit_many(effects))
        for claimed, attempt in done:
            moved = committed.get(claimed.operation.id)
            if moved is None:
                # Fenced or moved meanwhile: the single-row write finds out which, and logs it.
                await self._record_one(claimed, attempt)
            else:
                observe_outcome(self.metrics, moved)
        return [None] * len(done)

    async def _record_one(self, claimed: Claimed, attempt: Attempt) -> None:
        operation = claimed.operation
        move = policy.after_attempt(operation, claimed.contract, attempt)
        try:
            moved = await self.database.run(transition_plan(operation, move))
            observe_outcome(self.metrics, moved)
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
