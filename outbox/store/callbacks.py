"""The provider callbacks inbox: the callbacks role records a verified callback through
one database function, which locks nothing a daemon's write waits for; the consumer
claims the callbacks it can apply, reads an operation's callbacks under the operation's
lock, and records what it did with each (which chains the callback's evidence event);
operators list them. docs/design.md section 5, "Callbacks"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from uuid import UUID

from outbox.callback_policy import CallbackReport
from outbox.errors import IllegalTransition
from outbox.models import Callback, CallbackOutcome, Operation
from outbox.store.runner import Plan, Step

ReceiptResult = Literal["recorded", "duplicate", "unmatched"]


@dataclass(frozen=True)
class CallbackReceipt:
    """What recording a callback came to."""

    result: ReceiptResult
    callback_id: int
    operation_id: UUID | None
    """The operation it was matched to; None when unmatched."""
    same_payload: bool
    """For a duplicate: whether it carried the body the first delivery had."""


def record_callback(provider: str, report: CallbackReport, digest: str) -> Plan[CallbackReceipt]:
    """Record a verified callback once by (provider, event id), with the operation it
    names; a redelivery changes nothing. It enters that operation's chain when the
    consumer applies it (:func:`mark_callback`)."""
    rows = yield Step(
        "record_callback",
        {
            "provider": provider,
            "event_id": report.event_id,
            "status": str(report.status),
            "operation_id": report.operation_id,
            "provider_reference": report.provider_reference,
            "payload_digest": digest,
        },
    )
    row = rows[0]
    return CallbackReceipt(
        result=row["result"],
        callback_id=row["callback_id"],
        operation_id=row["operation_id"],
        same_payload=bool(row["same_payload"]),
    )


def claim_callback_batch(tools: Sequence[str], limit: int) -> Plan[list[Callback]]:
    """Lock (until this transaction ends) up to ``limit`` callbacks not yet applied, with
    their operations: none in flight, each of a tool in ``tools`` (``name.vN``)."""
    rows = yield Step("claim_callback_batch", {"tools": list(tools), "limit": limit})
    return [Callback.model_validate(row) for row in rows]


def callbacks_of(operation_ids: Sequence[UUID]) -> Plan[dict[UUID, list[Callback]]]:
    """Every callback of these operations, in arrival order; an operation with none is
    absent."""
    if not operation_ids:
        return {}
    rows = yield Step("operation_callbacks", {"ids": list(operation_ids)})
    found: dict[UUID, list[Callback]] = {}
    for row in rows:
        callback = Callback.model_validate(row)
        assert callback.operation_id is not None
        found.setdefault(callback.operation_id, []).append(callback)
    return found


def mark_callback(callback: Callback, outcome: CallbackOutcome) -> Plan[None]:
    """Record what was done with ``callback``, which appends its
    ``operation.callback_received`` event to its operation's chain (a trigger, as the
    tables' owner); raises :class:`IllegalTransition` if another process applied it
    first."""
    rows = yield Step("apply_callback", {"id": callback.id, "outcome": str(outcome)})
    if not rows:
        raise IllegalTransition(f"callback {callback.id} was applied by another process first")


def lock_operation(operation_id: UUID) -> Plan[Operation | None]:
    """The operation, its row locked until this transaction ends (no callback being
    recorded holds it back)."""
    rows = yield Step("lock_operation", {"id": operation_id})
    return Operation.model_validate(rows[0]) if rows else None


def list_callbacks(
    *,
    unmatched: bool = False,
    contradicted: bool = False,
    pending: bool = False,
    provider: str | None = None,
    limit: int = 50,
) -> Plan[list[Callback]]:
    """Callbacks newest first, for operators."""
    outcome = (
        str(CallbackOutcome.UNMATCHED)
        if unmatched
        else str(CallbackOutcome.CONTRADICTED)
        if contradicted
        else None
    )
    rows = yield Step(
        "list_callbacks",
        {"outcome": outcome, "pending": pending, "provider": provider, "limit": limit},
    )
    return [Callback.model_validate(row) for row in rows]
