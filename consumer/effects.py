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
from consumer.policy import (
    LEASE_LOST_BEFORE_CALL,
    Attempt,
    AttemptOutcome,
    ProviderWait,
    Transition,
    Unavailability,
)
from consumer.providers import Providers
from consumer.telemetry import log, log_fenced, observe_outcome, span_attributes
from outbox import store, tracing
from outbox.breaker import Failure, Hold, could_not_reach
from outbox.contracts import SideEffect
from outbox.errors import IllegalTransition
from outbox.metrics import ConsumerMetrics
from outbox.models import Operation
from outbox.outcomes import (
    DefinitiveRejection,
    EffectSignal,
    ExecutionContext,
    InProgress,
    NotSent,
    OutcomeUnknown,
    ProviderUnavailable,
    RateLimited,
)
from outbox.settings import Settings
from outbox.store import Plan

# The code of an attempt held back before its call by the provider's breaker or its
# Retry-After (an event attribute, like every code).
HELD_BACK = "held_back"

# Attempts that say nothing of the provider's health: the tool raised something that is
# no signal (its own failure, not the provider's answer).
_SAYS_NOTHING = frozenset({"tool_error"})

# A 409 "same key in flight" waits and sends the key again only where sending it again
# is what the class allows without a lookup: a deduplicated write (the provider answers
# a repeated key with the first request's outcome) and a read.
_MAY_SEND_A_KEY_AGAIN = frozenset({SideEffect.DEDUPLICATED_WRITE, SideEffect.READ_ONLY})


def _unavailable(signal: EffectSignal) -> Attempt:
    unavailability = (
        Unavailability.RATE_LIMITED
        if isinstance(signal, RateLimited)
        else Unavailability.IN_PROGRESS
        if isinstance(signal, InProgress)
        else Unavailability.UNREACHABLE
    )
    return Attempt(
        AttemptOutcome.UNAVAILABLE,
        signal.code,
        retry_after=signal.retry_after,
        unavailability=unavailability,
    )


class Effects:
    """The call and its record, for one consumer."""

    def __init__(
        self,
        settings: Settings,
        metrics: ConsumerMetrics,
        database: Database,
        providers: Providers | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.database = database
        self.providers = providers
        self._commits = Batcher(self._record_many, limit=database.burst_limit)

    async def attempt(self, claimed: Claimed, traceparent: str | None = None) -> Attempt:
        """Call the tool once for ``claimed``, in a span that continues the decision's
        trace, and give back its place among the provider's calls out if it holds one;
        never raises, whatever the tool does."""
        try:
            return await self._traced_attempt(claimed, traceparent)
        finally:
            if claimed.holds_place and self.providers is not None:
                await self.providers.give_back_place(claimed.contract, claimed.operation.id)

    async def _traced_attempt(self, claimed: Claimed, traceparent: str | None) -> Attempt:
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
        if await self._held_back(claimed):
            # Claimed before the provider's breaker opened or its Retry-After arrived (in
            # this process's burst, or another's): no call until it lets one through.
            return Attempt(
                AttemptOutcome.UNAVAILABLE, HELD_BACK, unavailability=Unavailability.HELD
            )
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
        except (ProviderUnavailable, RateLimited) as unavailable:
            attempt = _unavailable(unavailable)
        except NotSent as not_sent:
            # Refused or unreachable is the provider down, not this request's fault.
            attempt = (
                _unavailable(ProviderUnavailable(not_sent.code, retry_after=not_sent.retry_after))
                if could_not_reach(not_sent.code)
                else Attempt(AttemptOutcome.NOT_SENT, not_sent.code)
            )
        except InProgress as in_progress:
            # Still working on this key: sending the same key again later is safe where
            # the class lets a key repeat; elsewhere the effect is as unknown as any.
            attempt = (
                _unavailable(in_progress)
                if contract.side_effect in _MAY_SEND_A_KEY_AGAIN
                else Attempt(AttemptOutcome.OUTCOME_UNKNOWN, in_progress.code)
            )
        except OutcomeUnknown as unknown:
            attempt = Attempt(
                AttemptOutcome.OUTCOME_UNKNOWN, unknown.code, retry_after=unknown.retry_after
            )
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

    async def _held_back(self, claimed: Claimed) -> bool:
        """Whether the provider's breaker or Retry-After now holds this call back (the
        probe itself goes out). Asks a fresh copy only when this process's says so."""
        if self.providers is None or claimed.probe is not None:
            return False
        provider = claimed.contract.provider_name
        if not isinstance(self.providers.verdict(provider), Hold):
            return False
        return isinstance(await self.providers.fresh_verdict(provider), Hold)

    async def record(self, claimed: Claimed, attempt: Attempt) -> None:
        """Record the outcome where :func:`consumer.policy.after_attempt` says it leads,
        under the claim's fencing token, and what it says of the provider's health.
        Confirmed effects share one transaction with those that finish in the same
        burst."""
        wait = await self._tell_provider(claimed, attempt)
        if attempt.outcome is AttemptOutcome.COMMITTED:
            await self._commits.submit((claimed, attempt))
        else:
            await self._record_one(claimed, attempt, wait)

    async def _tell_provider(self, claimed: Claimed, attempt: Attempt) -> ProviderWait | None:
        """Tell the provider's breaker what this attempt says of it: no answer (which may
        open it), or an answer (which closes it); returns how long the operation waits
        when the provider could not take it."""
        if self.providers is None:
            return None
        contract, operation = claimed.contract, claimed.operation
        provider = contract.provider_name
        unavailability = attempt.unavailability
        if unavailability is Unavailability.HELD or attempt.code in _SAYS_NOTHING:
            pass  # never called, or the tool itself failed: nothing said of the provider
        elif unavailability is Unavailability.IN_PROGRESS or not (
            unavailability is not None or could_not_reach(attempt.code)
        ):
            if attempt.outcome is not AttemptOutcome.NOT_SENT:
                await self.providers.answered(provider)
        else:
            await self.providers.failed(
                provider,
                Failure(
                    operation.id,
                    attempt.code,
                    retry_after=attempt.retry_after,
                    prober=claimed.probe,
                    counts=unavailability is not Unavailability.RATE_LIMITED,
                ),
            )
        if attempt.outcome is not AttemptOutcome.UNAVAILABLE:
            return None
        return self.providers.wait(contract, operation, retry_after=attempt.retry_after)

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

    def _move_plan(
        self, claimed: Claimed, attempt: Attempt, wait: ProviderWait | None
    ) -> Plan[tuple[Operation, Transition]]:
        """Where the attempt leads, written in one transaction; a wait for the provider
        is first checked against the breaker under its row's share lock
        (:meth:`Providers.confirmed`)."""
        if wait is not None and self.providers is not None:
            wait = yield from self.providers.confirmed(wait)
        move = policy.after_attempt(claimed.operation, claimed.contract, attempt, wait)
        moved = yield from transition_plan(claimed.operation, move)
        return moved, move

    async def _record_one(
        self, claimed: Claimed, attempt: Attempt, wait: ProviderWait | None = None
    ) -> None:
        operation = claimed.operation
        try:
            moved, move = await self.database.run(self._move_plan(claimed, attempt, wait))
            observe_outcome(self.metrics, moved)
            if move.then is not None:
                # The effect may have happened and no lookup can tell, or the provider
                # stayed away past the contract's tolerance: a person decides.
                self.metrics.escalations.labels(claimed.contract.name, str(move.then.reason)).inc()
        except IllegalTransition as fenced:
            log_fenced(operation, fenced, token=operation.lease_token, outcome=str(attempt.outcome))
