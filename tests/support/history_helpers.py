"""History retention under test: operations that settled long ago, moved into history
as `outbox history archive` moves them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg

from outbox import Operation
from outbox import store as outbox_store
from outbox.models import ApprovalDecision

from support.ops_helpers import LEASE, Ops

HOT = timedelta(hours=1)


def settled_days_ago(database_url: str, operation_id: UUID, days: int) -> None:
    """What only the owner could do, and what the test needs: the operation settled
    ``days`` ago (its settled time is its last update; a terminal row takes none), its
    message published long since."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET updated_at = now() - make_interval(days => %s) WHERE id = %s",
            (days, operation_id),
        )
        connection.execute(
            "UPDATE outbox SET published_at = now() WHERE operation_id = %s", (operation_id,)
        )


def archive_all(ops: Ops, hot: timedelta = HOT, batch: int = 100) -> list[Any]:
    """Every batch the archive command would move, as ``ops``' login; their checkpoints."""
    checkpoints: list[Any] = []
    while moved := ops.run(outbox_store.archive_batch(hot, batch)):
        checkpoints.extend(moved)
    return checkpoints


def approved(ops: Ops, approver: str = "lead@example.com") -> Operation:
    """A prepared operation whose contract asks for an approval, granted by ``approver``:
    what an archived operation's approval check and approvals show."""
    operation = ops.new(amount_cents=90_000)
    ops.run(
        outbox_store.decide_approval(
            operation.id, decision=ApprovalDecision.GRANTED, approved_by=approver, ttl=LEASE
        )
    )
    return operation
