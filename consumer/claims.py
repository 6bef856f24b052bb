"""Deliveries to claims: load each delivery's operation, check it, and claim the ones
that may run, a burst at a time in one transaction committed before any call.

A delivery that must not run is a :class:`Skip` with its result label (and, for a
message that can never be right, why it is dead-lettered); the checks write their
evidence (an unknown tool, a tampered row, a missing approval, a replay too late for
its dedupe window) in the same transaction. One that may run is :class:`Claimed`: in
flight under a new lease and fencing token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from consumer import policy
from consumer.batching import Batcher
from consumer.database import Database, quarantine_unreadable, transition_plan
from consumer.policy import ProviderWait
from consumer.providers import BOOKING_RETRY, Providers
from consumer.telemetry import log
from outbox import store
from outbox.bounds import is_unreadable
from outbox.breaker import Go, Hold, Probe
from outbox.broker import OperationMessage
from outbox.contracts import Registry, ToolContract
from outbox.errors import IllegalTransition, ToolNotRegistered
from outbox.intent import derive_intent
from outbox.metrics import ConsumerMetrics
from outbox.models import Operation
from outbox.settings import Settings
from outbox.states import EventName, OperationState
from outbox.store import AsyncStore

S = OperationState
# A delivery asks for a turn under its provider's rate this many times more, a
# BOOKING_RETRY apart, before it books one however far off.
BOOKING_RETRIES = 24


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
    # The probe of the provider's open breaker this call is, if it is one: only the
    # probe's failure opens the breaker again.
    probe: str | None = None
    # Whether this call holds a place among the calls out to a provider that declares how
    # many it takes at once: given back when the call ends.
    holds_place: bool = False


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


class Claims:
    """Claims deliveries for one consumer; the deliveries that arrive in the same burst
    share one transaction (group commit, :class:`consumer.batching.Batcher`)."""

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
        self.settings = settings
        self.registry = registry
        self.metrics = metrics
        self.database = database
        self.worker_id = worker_id
        self.providers = providers or Providers(
            settings, registry, metrics, database, worker_id=worker_id
        )
        self._batcher = Batcher(self._prepare_many, limit=database.burst_limit)

    async def claim(self, envelope: OperationMessage) -> Claimed | Skip:
        """Load, check and claim one delivery, in the transaction of its burst, once its
        provider's declared limits give it a turn and a place."""
        placed = await self._await_turn(envelope)
        if placed is None:
            return await self._batcher.submit(envelope)
        result: Claimed | Skip | None = None
        try:
            result = await self._batcher.submit(envelope)
        finally:
            if not isinstance(result, Claimed):
                await self.providers.give_back_place(placed, envelope.operation_id)
        if isinstance(result, Skip):
            return result
        return replace(result, holds_place=True)

    async def _await_turn(self, envelope: OperationMessage) -> ToolContract[Any] | None:
        """Hold the delivery in hand until its turn under its provider's declared rate
        and a place among its calls out (a prefetch slot taken meanwhile is the
        backpressure): both taken before the claim, so the wait never eats the lease.
        Returns the contract when a place was taken, for it to be given back. A delivery
        its provider's breaker or Retry-After holds back takes neither; it waits in the
        database instead."""
        try:
            contract = self.registry.get(envelope.tool, envelope.tool_version)
        except ToolNotRegistered:
            return None
        if contract.provider_limits is None:
            return None
        for retry in range(BOOKING_RETRIES + 1):
            if isinstance(self.providers.verdict(contract.provider_name), Hold):
                return None
            # Held too long already: book the turn however far off, so that the delivery
            # is not held past what the broker tolerates.
            wait = await self.providers.turn(contract, force=retry == BOOKING_RETRIES)
            if wait is not None:
                if wait > 0:
                    await asyncio.sleep(wait)
                break
            await asyncio.sleep(BOOKING_RETRY.total_seconds())
        if contract.provider_limits.concurrent_calls is None:
            return None
        # Calls out end within their deadline, so a place frees up within one.
        while True:
            place = await self.providers.take_place(contract, envelope.operation_id)
            if place is None:
                return contract
            if isinstance(self.providers.verdict(contract.provider_name), Hold):
                return None
            await asyncio.sleep(place)

    async def _prepare_many(self, envelopes: list[OperationMessage]) -> list[Claimed | Skip]:
        """Hold back the deliveries whose provider may not be called now, and claim the
        rest (:meth:`_claim_burst`)."""
        probes: dict[UUID, str] = {}
        held = await self._held_back(envelopes, probes)
        if not held:
            return self._with_probes(await self._claim_burst(envelopes), probes)
        rest = [envelope for index, envelope in enumerate(envelopes) if index not in held]
        claimed = iter(self._with_probes(await self._claim_burst(rest), probes) if rest else [])
        return [held[index] if index in held else next(claimed) for index in range(len(envelopes))]

    async def _held_back(
        self, envelopes: list[OperationMessage], probes: dict[UUID, str]
    ) -> dict[int, Skip]:
        """The deliveries (by position) whose provider holds its calls back (an open
        breaker, a Retry-After): each operation waits, due again later, spending no
        attempt, or goes to a person past its contract's outage tolerance. A delivery
        whose operation is not a prepared one waiting its turn goes the usual way, and
        the first delivery of a provider whose probe is due goes out as the probe.
        Asks the database nothing while every provider is healthy: the breakers' copy
        is refreshed on a loop of its own (:meth:`Providers.run`)."""
        holding: dict[int, tuple[OperationMessage, ToolContract[Any], Hold | None]] = {}
        for index, envelope in enumerate(envelopes):
            try:
                contract = self.registry.get(envelope.tool, envelope.tool_version)
            except ToolNotRegistered:
                continue
            if isinstance(self.providers.verdict(contract.provider_name), Go):
                continue
            verdict = await self.providers.fresh_verdict(contract.provider_name)
            if isinstance(verdict, Go):
                continue
            if isinstance(verdict, Probe):
                if envelope.operation_id not in probes:
                    probe = await self.providers.take_probe(
                        contract.provider_name, envelope.operation_id, contract.deadline
                    )
                    if probe is not None:
                        probes[envelope.operation_id] = probe
                        continue
                verdict = self.providers.verdict(contract.provider_name)
                if isinstance(verdict, Go):
                    continue
            holding[index] = (envelope, contract, verdict if isinstance(verdict, Hold) else None)
        if not holding:
            return {}
        async with self.database.transaction() as connection:
            runner = await AsyncStore.on(connection)
            return await self._wait(runner, holding)

    async def _wait(
        self,
        runner: AsyncStore,
        holding: dict[int, tuple[OperationMessage, ToolContract[Any], Hold | None]],
    ) -> dict[int, Skip]:
        operations = await runner.run(
            store.find_operations(
                list(dict.fromkeys(e.operation_id for e, _, _ in holding.values()))
            )
        )
        results: dict[int, Skip] = {}
        waits: dict[tuple[str, str], list[tuple[Operation, timedelta]]] = {}
        positions: dict[UUID, int] = {}
        for index, (envelope, contract, hold) in holding.items():
            operation = operations.get(envelope.operation_id)
            if (
                operation is None
                or operation.state is not S.PREPARED
                or operation.requires_approval
                or not _describes(envelope, operation)
            ):
                continue  # the usual checks say what it is
            if operation.id in positions:
                results[index] = Skip("duplicate")
                continue
            positions[operation.id] = index
            held_by = self.providers.wait(contract, operation)
            wait = await runner.run(self.providers.confirmed(held_by))
            if held_by.outage is not None and wait.outage is None:
                del positions[operation.id]
                continue  # the breaker closed meanwhile: claimed the usual way
            if wait.waited >= contract.outage_tolerance:
                results[index] = await self._escalate_unavailable(runner, operation, contract, wait)
                continue
            reason = "provider_unavailable" if hold is None or hold.outage else "retry_after"
            waits.setdefault((wait.provider, reason), []).append((operation, wait.delay))
        for (provider, reason), delays in waits.items():
            moved = await runner.run(store.wait_prepared(delays, provider=provider, reason=reason))
            for operation, _ in delays:
                if operation.id in moved:
                    results[positions[operation.id]] = Skip("waiting")
                else:
                    # Claimed meanwhile, or not yet due: an early copy of its message.
                    results[positions[operation.id]] = Skip("duplicate")
        return results

    async def _escalate_unavailable(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        wait: ProviderWait,
    ) -> Skip:
        decision = policy.provider_unavailable(operation, contract, wait, source=S.PREPARED)
        try:
            await runner.run(transition_plan(operation, decision.transition))
        except IllegalTransition:
            return Skip("duplicate")
        self.metrics.escalations.labels(contract.name, str(decision.reason)).inc()
        return Skip("escalated")

    @staticmethod
    def _with_probes(
        results: list[Claimed | Skip], probes: dict[UUID, str]
    ) -> list[Claimed | Skip]:
        if not probes:
            return results
        return [
            replace(result, probe=probes[result.operation.id])
            if isinstance(result, Claimed) and result.operation.id in probes
            else result
            for result in results
        ]

    async def _claim_burst(self, envelopes: list[OperationMessage]) -> list[Claimed | Skip]:
        """Check and claim a burst of deliveries in one transaction, committed before any
        of their external calls, each with its own lease and a new fencing token.

        One statement claims every operation that its message matches and that needs no
        approval, and the checks read what it returned; only the rest are read first.
        A claimed operation that fails a check rolls the burst back, and the burst is
        then read, checked and claimed again the way that writes that check's evidence:
        rare (a tampered row, an unreadable input, a passed replay window), and never a
        call, since nothing was committed."""
        began = time.monotonic()
        try:
            async with self.database.transaction() as connection:
                runner = await AsyncStore.on(connection)
                await self.database.remember_fingerprint_key(runner)
                return await self._claim_then_check(runner, envelopes, began)
        except _Recheck:
            pass
        async with self.database.transaction() as connection:
            runner = await AsyncStore.on(connection)
            return await self._check_then_claim(runner, envelopes, began)

    async def _claim_then_check(
        self, runner: AsyncStore, envelopes: list[OperationMessage], began: float
    ) -> list[Claimed | Skip]:
        """Claim what the messages name in one statement, check what it returned, and
        hand the deliveries it did not claim to :meth:`_check_then_claim`; raises
        :class:`_Recheck` when a claimed operation fails a check."""
        contracts: dict[UUID, ToolContract[Any]] = {}
        deliveries: list[store.DeliveryClaim] = []
        for envelope in envelopes:
            if envelope.operation_id in contracts:
                continue
            try:
                # The claim matches the row's tool to the message's, so this is the row's.
                contract = self.registry.get(envelope.tool, envelope.tool_version)
            except ToolNotRegistered:
                continue
            contracts[envelope.operation_id] = contract
            deliveries.append(
                store.DeliveryClaim(
                    envelope.operation_id,
                    envelope.tool,
                    envelope.tool_version,
                    envelope.input_fingerprint,
                    lease=self._lease(contract),
                )
            )
        claimed = await runner.run(store.claim_deliveries(deliveries, owner=self.worker_id))
        runnable: dict[UUID, _Runnable] = {}
        for operation_id, delivery in claimed.items():
            verdict = _may_run(delivery, contracts[operation_id])
            if verdict is None:
                raise _Recheck
            runnable[operation_id] = verdict
        results: list[Claimed | Skip | None] = []
        rest: list[OperationMessage] = []
        for envelope in envelopes:
            taken = claimed.get(envelope.operation_id)
            if taken is None:
                results.append(None)
                rest.append(envelope)
                continue
            if not _describes(envelope, taken.operation):
                # Another message about the same operation that the claimed row refutes:
                # what the checks say of it whether or not its neighbour came first.
                results.append(Skip("invalid", "envelope_mismatch"))
                continue
            verdict = runnable.pop(envelope.operation_id, None)
            if verdict is None:
                # A second delivery of an operation this burst claimed: a duplicate.
                results.append(await _suppressed(runner, taken.operation))
            else:
                results.append(
                    Claimed(
                        taken.operation,
                        verdict.contract,
                        lease_safe_until=began + self._lease(verdict.contract).total_seconds(),
                        tool_input=verdict.tool_input,
                    )
                )
        if not rest:
            return [result for result in results if result is not None]
        checked = iter(await self._check_then_claim(runner, rest, began))
        return [next(checked) if result is None else result for result in results]

    def _lease(self, contract: ToolContract[Any]) -> timedelta:
        return contract.deadline + timedelta(seconds=self.settings.lease_margin)

    async def _check_then_claim(
        self, runner: AsyncStore, envelopes: list[OperationMessage], began: float
    ) -> list[Claimed | Skip]:
        """Load, check and claim deliveries: one round trip loads them all, the checks
        write their evidence, one statement claims those that may run."""
        operations = await runner.run(
            store.find_operations(list(dict.fromkeys(e.operation_id for e in envelopes)))
        )
        verdicts: list[Skip | _Runnable] = []
        wanted: dict[UUID, timedelta] = {}
        for envelope in envelopes:
            verdict = await self._check(runner, envelope, operations.get(envelope.operation_id))
            verdicts.append(verdict)
            if not isinstance(verdict, Skip):
                wanted.setdefault(envelope.operation_id, self._lease(verdict.contract))
        claimed = await runner.run(store.claim_many(sorted(wanted.items()), owner=self.worker_id))
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
        if not _describes(envelope, operation):
            return Skip("invalid", "envelope_mismatch")
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
        if is_unreadable(operation.input):
            return await self._unreadable(runner, operation, contract)
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
        if policy.blind_replay_too_late(operation, contract, now=datetime.now(UTC)):
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

    async def _unreadable(
        self, runner: AsyncStore, operation: Operation, contract: ToolContract[Any]
    ) -> Skip:
        """Never executed, never a crash that takes the burst's other deliveries with it:
        quarantined as the third ending, for a person to end with `outbox ops resolve`
        or `ops cancel`."""
        try:
            await quarantine_unreadable(runner, self.metrics, operation, contract.name)
        except IllegalTransition:
            return Skip("duplicate")  # a second delivery of it in the same burst
        return Skip("unreadable")

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


def _describes(envelope: OperationMessage, operation: Operation) -> bool:
    """Whether the message names the operation's recorded tool, version and intent."""
    return (
        operation.input_fingerprint == envelope.input_fingerprint
        and operation.tool_name == envelope.tool
        and operation.tool_version == envelope.tool_version
    )


class _Recheck(Exception):
    """An operation the burst's claim took failed a check: roll the claim back."""


def _may_run(delivery: store.ClaimedDelivery, contract: ToolContract[Any]) -> _Runnable | None:
    """The checks of :meth:`Claims._check` that a prepared operation can fail, asked of
    one that the claim took (so already known to match its message and to need no
    approval); None when one fails. Pure: the evidence of a failure is written by
    :meth:`Claims._check` once the claim is rolled back."""
    operation = delivery.operation
    if is_unreadable(operation.input):
        return None
    intent = derive_intent(contract, operation)
    if intent.disagreement is not None or intent.requires_approval:
        return None
    if policy.can_outlive_dedupe_window(contract) and policy.blind_replay_too_late(
        delivery.before, contract, now=datetime.now(UTC)
    ):
        return None
    return _Runnable(contract, intent.tool_input)


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
