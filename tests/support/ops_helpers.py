"""Building operations in any state along legal edges, for tests of the state machine
and of the operator commands."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg

from outbox import Operation, OperationEvent, OperationState, Registry, record_decision
from outbox import store as outbox_store
from outbox.fingerprint_key import keyed_fingerprint
from outbox.store import Plan, Store

from support.db_helpers import execute_admin

S = OperationState
LEASE = timedelta(seconds=60)

# How to bring a fresh operation to each state along legal edges only.
PATH_TO = {
    S.PREPARED: [],
    S.IN_FLIGHT: [S.IN_FLIGHT],
    S.COMMITTED: [S.IN_FLIGHT, S.COMMITTED],
    S.REJECTED: [S.IN_FLIGHT, S.REJECTED],
    S.OUTCOME_UNKNOWN: [S.IN_FLIGHT, S.OUTCOME_UNKNOWN],
    S.ESCALATED: [S.IN_FLIGHT, S.OUTCOME_UNKNOWN, S.ESCALATED],
}


class Ops:
    """Runs store plans, each in its own committed transaction. ``free_text`` goes into
    every input's free-text field (a canary that must never surface)."""

    def __init__(self, database_url: str, registry: Registry, *, free_text: str = "") -> None:
        self.database_url = database_url
        self.registry = registry
        self.free_text = free_text

    def run(self, plan: Plan[Any]) -> Any:
        with psycopg.connect(self.database_url) as connection:
            return Store(connection).run(plan)

    def new(
        self, amount_cents: int = 100, tool: str = "send_refund", run_id: str = "run"
    ) -> Operation:
        tool_input: dict[str, Any] = (
            {"payment_id": "pay_1", "amount_cents": amount_cents, "reason": self.free_text}
            if tool == "send_refund"
            else {"title": self.free_text or "ticket", "body": self.free_text}
        )
        with psycopg.connect(self.database_url) as connection:
            recorded = record_decision(connection, self.registry, tool, tool_input, run_id=run_id)
        return recorded.operation

    def short(self, fingerprint: str) -> str:
        """The keyed short fingerprint: the one form every view shows a person."""
        key: str = self.run(outbox_store.fingerprint_key())
        return keyed_fingerprint(key, fingerprint)

    def approvers(self, operation_id: UUID) -> list[str | None]:
        """Who made each approval decision of an operation, newest first (what only an
        operator reads)."""
        approvals = self.run(outbox_store.operation_approvals(operation_id))
        return [approval.approved_by for approval in approvals]

    def get(self, operation_id: UUID) -> Operation:
        operation: Operation = self.run(outbox_store.get_operation(operation_id))
        return operation

    def events(self, operation_id: UUID) -> list[OperationEvent]:
        events: list[OperationEvent] = self.run(outbox_store.events(operation_id))
        return events

    def event_names(self, operation_id: UUID) -> list[str]:
        return [event.name for event in self.events(operation_id)]

    def lengthen(self, operation_id: UUID, count: int, name: str = "agent.completed") -> list[int]:
        """Append ``count`` events to an operation in one statement, as the table's owner
        (the chain trigger hashes each, as it does a daemon's), and return the ids of
        all its events, oldest first: a timeline as long as a long outage makes one."""
        execute_admin(
            self.database_url,
            "INSERT INTO operation_events (operation_id, name, attributes) "
            "SELECT %s, %s, jsonb_build_object('agent.n', n) FROM generate_series(1, %s) n",
            (operation_id, name, count),
        )
        rows = execute_admin(
            self.database_url,
            "SELECT id FROM operation_events WHERE operation_id = %s ORDER BY id",
            (operation_id,),
        )
        return [int(row[0]) for row in rows]

    def escalated_at_claim(self, reason: str, **attributes: Any) -> Operation:
        """A fresh operation the consumer escalated before any attempt (``tampered``,
        ``undeliverable``, ...), with the reason its move records."""
        moved: Operation = self.run(
            outbox_store.transition(
                self.new().id,
                source=S.PREPARED,
                target=S.ESCALATED,
                attributes={"reason": reason, **attributes},
            )
        )
        return moved

    def escalated_for(self, reason: str, **new: Any) -> Operation:
        """A fresh operation attempted, its outcome unknown, then escalated for
        ``reason`` (as a provider fault leaves many)."""
        unknown = self.at(S.OUTCOME_UNKNOWN, **new)
        moved: Operation = self.run(
            outbox_store.transition(
                unknown.id,
                source=S.OUTCOME_UNKNOWN,
                target=S.ESCALATED,
                attributes={"reason": reason},
            )
        )
        return moved

    def move(self, operation: Operation, target: OperationState) -> Operation:
        if target is S.IN_FLIGHT:
            claimed: Operation | None = self.run(
                outbox_store.claim(operation.id, owner="worker-a", lease=LEASE)
            )
            assert claimed is not None
            return claimed
        moved: Operation = self.run(
            outbox_store.transition(
                operation.id,
                source=operation.state,
                target=target,
                lease_token=operation.lease_token,
                provider_reference="re_found" if target is S.COMMITTED else None,
                error_class="lookups_unavailable" if target is S.ESCALATED else None,
            )
        )
        return moved

    def rejected_in_store(self, operation: Operation, *, evidence: str, by: str) -> Operation:
        """An escalated operation resolved as rejected through the store alone, past the
        operator layer's rules: what an older version or another writer could store."""
        resolved: Operation = self.run(
            outbox_store.resolve_operation(
                operation.id,
                source=S.ESCALATED,
                target=S.REJECTED,
                decision="rejected",
                resolved_by=by,
                evidence=evidence,
            )
        )
        return resolved

    def at(self, state: OperationState, **new: Any) -> Operation:
        operation = self.new(**new)
        for step in PATH_TO[state]:
            operation = self.move(operation, step)
        assert operation.state is state
        return operation
