"""What the hostile-value tests share: logins per role, recording as one, poisoning a
row behind the triggers' back, reading what was written.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import psycopg.errors

from outbox import Operation, OperationState, Registry, record_decision
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.fingerprint import intent_fingerprint
from outbox.models import Approval, ApprovalDecision

from support.db_helpers import execute_admin
from support.ops_helpers import Ops

S = OperationState


AGENT, DISPATCHER, CONSUMER, OPERATOR, CALLBACKS = outbox_schema.ROLES


DEEP = "[" * 2000 + "]" * 2000


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


RECORD_DECISION = (
    "SELECT id FROM outbox_record_decision(%s, %s, %s, 'send_refund', 1, "
    "'deduplicated_write', %s::jsonb, %s, false, %s::jsonb)"
)


def refund(amount_cents: int = 100, **more: Any) -> dict[str, Any]:
    return {"payment_id": f"pay_{uuid.uuid4().hex[:8]}", "amount_cents": amount_cents, **more}


def record_as(url: str, registry: Registry, tool_input: dict[str, Any]) -> Operation:
    with psycopg.connect(url) as connection:
        return record_decision(
            connection, registry, "send_refund", tool_input, run_id="r"
        ).operation


def fingerprint_of(tool_input: dict[str, Any]) -> str:
    return intent_fingerprint("send_refund", 1, tool_input)


def refused(url: str, statement: str, params: Any = None) -> psycopg.Error:
    """Run ``statement`` as ``url``'s user; it must be refused. Returns the error."""
    with psycopg.connect(url) as connection:
        try:
            connection.execute(statement, params)
        except psycopg.Error as error:
            return error
    raise AssertionError(f"the database accepted: {statement}")


def decide(
    ops: Ops,
    operation_id: UUID,
    decision: ApprovalDecision,
    ttl: timedelta = timedelta(minutes=15),
) -> Approval:
    """A person's grant or denial, through the store, as lead@example.com."""
    approval: Approval = ops.run(
        outbox_store.decide_approval(
            operation_id, decision=decision, approved_by="lead@example.com", ttl=ttl
        )
    )
    return approval


def events_of(database_url: str, operation_id: UUID) -> list[tuple[str, Any]]:
    rows = execute_admin(
        database_url,
        "SELECT name, attributes FROM operation_events WHERE operation_id = %s ORDER BY seq",
        (operation_id,),
    )
    return [(str(name), attributes) for name, attributes in rows]
