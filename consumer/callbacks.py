"""The reconciler's inbox: applying verified provider callbacks to their operations
(docs/design.md section 5, "Callbacks"; section 9).

Every decision is :func:`consumer.callback_decisions.after_callback`'s, taken with the operation's
row locked and its callbacks read after the lock: a callback recorded meanwhile waits
for the decision (``outbox_record_callback`` share-locks the row), so none is decided
around. Each callback's outcome is written once, in the transaction that writes what it
caused.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from consumer.callback_decisions import CallbackDecision, after_callback
from consumer.database import Database, transition_plan
from consumer.telemetry import log, observe_outcome
from outbox import store
from outbox.callback_policy import CallbackStatus
from outbox.contracts import Registry, ToolContract
from outbox.errors import ToolNotRegistered
from outbox.metrics import ConsumerMetrics
from outbox.models import Callback, CallbackOutcome, Operation
from outbox.states import EventName, OperationState
from outbox.store import AsyncStore

S = OperationState


class Applied:
    """What one transaction applied, counted once it has committed."""

    def __init__(self) -> None:
        self.outcomes: Counter[tuple[str, CallbackOutcome]] = Counter()
        self.contradicted: Counter[str] = Counter()
        self.escalated: Counter[str] = Counter()
        self.moved: list[Operation] = []

    def count(self, metrics: ConsumerMetrics) -> None:
        for (tool, outcome), times in self.outcomes.items():
            metrics.callbacks_applied.labels(tool, str(outcome)).inc(times)
        for tool, times in self.contradicted.items():
            metrics.callbacks_contradicted.labels(tool).inc(times)
        for tool, times in self.escalated.items():
            metrics.escalations.labels(tool, "contradicted").inc(times)
        for moved in self.moved:
            observe_outcome(metrics, moved)


def success_reported(callbacks: Sequence[Callback], contract: ToolContract[Any], but: int) -> bool:
    """Whether the contract's provider reported the effect done, in a callback other
    than ``but``."""
    provider = contract.callbacks.provider.name if contract.callbacks else None
    return any(
        c.id != but and c.status is CallbackStatus.COMMITTED and c.provider == provider
        for c in callbacks
    )


class Callbacks:
    """Applies callbacks for one consumer: a pass over the inbox, and the operations the
    reconciler is about to decide."""

    def __init__(
        self, registry: Registry, metrics: ConsumerMetrics, database: Database, *, batch: int
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.database = database
        self.batch = batch
        self.tools = [f"{contract.name}.v{contract.version}" for contract in registry]

    async def apply_pending(self) -> int:
        """Apply up to ``batch`` callbacks whose operations are not in flight; returns
        how many."""
        applied = Applied()
        async with self.database.transaction() as connection:
            runner = await AsyncStore.on(connection)
            claimed = await runner.run(store.claim_callback_batch(self.tools, self.batch))
            if claimed:
                ids = list(dict.fromkeys(c.operation_id for c in claimed if c.operation_id))
                operations = await runner.run(store.find_operations(ids))
                recorded = await runner.run(store.callbacks_of(ids))
                for callback in claimed:
                    assert callback.operation_id is not None
                    operation = operations[callback.operation_id]
                    operations[operation.id] = await self.apply(
                        runner, operation, callback, recorded.get(operation.id, []), applied
                    )
        applied.count(self.metrics)
        return len(claimed)

    async def pending_of(
        self, runner: AsyncStore, operations: Sequence[Operation]
    ) -> dict[UUID, list[Callback]]:
        """Every callback of these operations, read after their rows were locked."""
        return await runner.run(store.callbacks_of([o.id for o in operations]))

    async def settle(
        self,
        runner: AsyncStore,
        operation: Operation,
        callbacks: Sequence[Callback],
        applied: Applied,
    ) -> Operation:
        """Apply ``operation``'s callbacks not applied yet, oldest first, before anything
        else is decided about it; returns where they left it."""
        for callback in callbacks:
            if callback.outcome is None:
                operation = await self.apply(runner, operation, callback, callbacks, applied)
        return operation

    async def apply(
        self,
        runner: AsyncStore,
        operation: Operation,
        callback: Callback,
        callbacks: Sequence[Callback],
        applied: Applied,
    ) -> Operation:
        """Write what ``callback`` does to ``operation`` (locked by the caller) and mark
        it applied; returns where it left the operation."""
        try:
            contract = self.registry.get(operation.tool_name, operation.tool_version)
        except ToolNotRegistered:
            return operation  # a consumer that has the tool applies it
        decision = after_callback(
            operation,
            contract,
            callback,
            success_reported=success_reported(callbacks, contract, callback.id),
        )
        if decision is None:
            return operation
        return await self.write(runner, operation, contract, callback, decision, applied)

    async def write(
        self,
        runner: AsyncStore,
        operation: Operation,
        contract: ToolContract[Any],
        callback: Callback,
        decision: CallbackDecision,
        applied: Applied,
    ) -> Operation:
        if callback.outcome is None:
            # First: marking it applied chains its operation.callback_received event
            # (the callbacks_chain_received trigger), so the timeline shows the callback
            # before what it did. A success applied earlier as evidence that now
            # contradicts a lookup keeps the outcome it was given: written once.
            await runner.run(store.mark_callback(callback, decision.outcome))
            applied.outcomes[(contract.name, decision.outcome)] += 1
        if decision.contradiction is not None:
            attributes: dict[str, str | int | None] = {
                "reason": decision.contradiction,
                "callback": callback.id,
                "provider": callback.provider,
                "status": str(callback.status),
                "state": str(operation.state),
            }
            if callback.provider_reference is not None:
                attributes["provider_reference"] = callback.provider_reference
            await runner.run(store.append_event(operation, EventName.CONTRADICTED, attributes))
            applied.contradicted[contract.name] += 1
            log(
                logging.ERROR,
                "consumer.callback_contradicted",
                "a provider callback contradicts how the operation stands; a person must look",
                id=operation.display_id,
                tool=contract.name,
                callback=callback.id,
                reason=decision.contradiction,
            )
        if decision.move is not None:
            operation = await runner.run(transition_plan(operation, decision.move))
            applied.moved.append(operation)
            if operation.state is S.ESCALATED:
                applied.escalated[contract.name] += 1
        return operation
