"""What the operator front ends read beyond one store call: the operation a short id
names, and why an escalated operation was handed to a person, and since when.
``outbox ops`` and the console read them the same way."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from outbox import store
from outbox.errors import OperationNotFound
from outbox.models import display_operation_id, parse_operation_id
from outbox.states import EventName, OperationState
from outbox.store import Store

# The short id the console prints (`op_74ca7733`): a shorter prefix names too little to
# act on safely.
MIN_SHORT_ID = 8
_HEX = frozenset("0123456789abcdef")


def operation_id_of(runner: Store, text: str) -> UUID:
    """The operation ``text`` names: ``op_<uuid>``, a bare uuid, or the start of one
    (at least 8 hex digits, ``op_`` optional) that only one operation has."""
    given = text.strip()
    try:
        return parse_operation_id(given)
    except ValueError:
        pass
    prefix = given.lower().removeprefix("op_").replace("-", "")
    if len(prefix) < MIN_SHORT_ID or len(prefix) > 32 or not set(prefix) <= _HEX:
        raise OperationNotFound(
            f"{given!r} is not an operation id: expected op_<uuid>, a bare uuid, or the "
            f"start of one (at least {MIN_SHORT_ID} hex digits, as the console shows it)"
        )
    matches = runner.run(store.operations_with_prefix(prefix))
    if not matches:
        raise OperationNotFound(f"no operation id starts with {given!r}")
    if len(matches) > 1:
        first, second = (display_operation_id(m) for m in matches)
        raise OperationNotFound(
            f"{given!r} is ambiguous: {first}, {second} and maybe more start with it; give "
            "more of the id"
        )
    return matches[0]


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
