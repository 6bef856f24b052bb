"""What the operator front ends read beyond one store call: why an escalated operation
was handed to a person, and since when. ``outbox ops list`` and the console's
escalations read it the same way."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from outbox import store
from outbox.states import EventName, OperationState
from outbox.store import Store


@dataclass(frozen=True)
class Escalation:
    reason: str
    """The ``reason`` of the move to ``escalated`` (``tampered``, ``undeliverable``,
    ``escalate_by_contract``, ...), as the policy wrote it."""
    since: datetime


def escalations(
    runner: Store, operations: Iterable[tuple[UUID, OperationState]]
) -> dict[UUID, Escalation]:
    """The latest escalation of each escalated operation among ``operations``, read from
    its timeline (one query per escalated operation: a page holds at most a few dozen)."""
    found: dict[UUID, Escalation] = {}
    for operation_id, state in operations:
        if state is not OperationState.ESCALATED:
            continue
        moves = [
            event
            for event in runner.run(store.events(operation_id))
            if event.name == EventName.ESCALATED
        ]
        if moves:
            reason = moves[-1].attributes.get("reason")
            found[operation_id] = Escalation(
                reason=reason if isinstance(reason, str) else "-", since=moves[-1].created_at
            )
    return found
