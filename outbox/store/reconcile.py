"""The reconciler's statements (run by the consumer): lease unknown outcomes for a
lookup and defer inconclusive ones, and move on what nothing else would: requeue lost
messages, escalate undeliverable operations, reject denied ones."""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from outbox import lifecycle
from outbox.errors import LeaseLost
from outbox.models import Operation
from outbox.states import EventName
from outbox.store.operations import get_operation
from outbox.store.runner import Plan, Step


def claim_reconciliation_batch(limit: int) -> Plan[list[Operation]]:
    """Lock (until this transaction ends) unknown outcomes due for a lookup and in-flight
    operations whose lease expired: their worker died or stalled, so the effect may
    have happened."""
    rows = yield Step("claim_reconciliation_batch", {"limit": limit})
    return [Operation.model_validate(row) for row in rows]


def lease_for_reconciliation(
    operation: Operation, *, owner: str, lease: timedelta
) -> Plan[Operation | None]:
    """A reconciler's lease on an unknown outcome, with a new fencing token."""
    rows = yield Step(
        "lease_for_reconciliation",
        {"id": operation.id, "owner": owner, "lease": lease, "lease_token": operation.lease_token},
    )
    return Operation.model_validate(rows[0]) if rows else None


def defer_reconciliation(
    operation_id: UUID, *, lease_token: int, reason: str, delay: timedelta
) -> Plan[Operation]:
    """An inconclusive lookup: count it and look again after ``delay``."""
    rows = yield Step(
        "defer_reconciliation",
        {"id": operation_id, "lease_token": lease_token, "reason": reason, "delay": delay},
    )
    if not rows:
        current = yield from get_operation(operation_id)
        raise LeaseLost(
            f"{current.display_id} is {current.state} under lease token {current.lease_token}, "
            f"not outcome_unknown under {lease_token}; nothing was changed"
        )
    operation = Operation.model_validate(rows[0])
    lifecycle.emit(
        EventName.RECONCILE_DEFERRED,
        operation,
        {"reason": reason, "reconcile_attempt": operation.reconcile_attempts},
    )
    return operation


def requeue_stale_prepared(stale_after: timedelta, limit: int) -> Plan[list[UUID]]:
    """Give prepared operations whose message never led anywhere a new outbox row.

    A message can be dead-lettered (a database outage outlasting its delivery limit) or
    lost with a broker's disk; the operation row stays ``prepared`` and would otherwise
    wait forever. Operations waiting for an approval are left to their grant. A message
    merely waiting behind a backlog is left too (queries.sql says how it is told apart):
    sending it again there only doubles the work of consumers already behind.
    """
    rows = yield Step("requeue_stale_prepared", {"stale_after": stale_after, "limit": limit})
    return [row["operation_id"] for row in rows]


def escalate_undeliverable(
    stale_after: timedelta, cycles: int, limit: int
) -> Plan[list[tuple[UUID, str]]]:
    """Hand to a person the stale prepared operations that consumers positively refused:
    queued again ``cycles`` times, refused (an ``operation.dead_lettered`` event: a
    consumer without the tool) at least ``cycles`` times, the latest message refused
    too. Queueing them once more would loop forever. A requeue whose message met only
    timeouts, an unavailable database or a slow queue carries no refusal and never
    counts: slowness is not evidence. Returns each one's id and tool."""
    rows = yield Step(
        "escalate_undeliverable", {"stale_after": stale_after, "cycles": cycles, "limit": limit}
    )
    return [(row["operation_id"], row["tool_name"]) for row in rows]


def reject_denied_operations(grace: timedelta, limit: int) -> Plan[list[UUID]]:
    """End as rejected the prepared operations whose latest approval decision is a
    denial older than ``grace``: a decision denied and never granted is a definitive no."""
    rows = yield Step("reject_denied_operations", {"grace": grace, "limit": limit})
    return [row["operation_id"] for row in rows]
