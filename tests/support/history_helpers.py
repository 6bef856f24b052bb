"""What the history tests share: an operation settled long ago (what only the owner
could write, and what a test of the move needs), moving everything eligible as `outbox
history archive` moves it, the day an archived operation landed on, and an approved
operation."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg

from outbox import Operation, RecordedDecision, Registry, record_decision
from outbox import store as outbox_store
from outbox.models import ApprovalDecision
from outbox.store import Store

from support.db_helpers import execute_admin
from support.ops_helpers import LEASE, Ops
from support.waiting import eventually_sync

HOT = timedelta(hours=1)


def settled_days_ago(
    database_url: str, operation_id: UUID, days: int, *, published: bool = True
) -> None:
    """The operation settled ``days`` ago (its settled time is its last update; a
    terminal row takes none), its message published long since unless ``published`` is
    False (then the move passes it over until it is)."""
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET updated_at = now() - make_interval(days => %s) WHERE id = %s",
            (days, operation_id),
        )
        connection.execute(
            "UPDATE outbox SET published_at = CASE WHEN %s THEN now() END WHERE operation_id = %s",
            (published, operation_id),
        )


def archive_all(ops: Ops, hot: timedelta = HOT, batch: int = 100) -> list[Any]:
    """Every batch the archive command would move, as ``ops``' login; their checkpoints."""
    checkpoints: list[Any] = []
    while moved := ops.run(outbox_store.archive_batch(hot, batch)):
        checkpoints.extend(moved)
    return checkpoints


def archived_day(database_url: str, operation_id: UUID) -> str:
    rows = execute_admin(
        database_url,
        "SELECT settled_on::text FROM history WHERE operation_id = %s",
        (operation_id,),
    )
    return str(rows[0][0])


def wait_for_lock_waiters(database_url: str, what: str, *, running: str = "%") -> None:
    """Until one session of this database (whose statement is like ``running``) waits
    for a lock: the interleaving a race test holds."""
    eventually_sync(
        lambda: (
            execute_admin(
                database_url,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE %s",
                (running,),
            )
            == [(1,)]
        ),
        within=10,
        what=what,
    )


def race_an_open_batch(database_url: str, racer: Callable[[], None], what: str) -> bool:
    """``racer`` in a thread of its own while a batch has moved what it moves and not
    committed, until it waits for a lock (``what``); then the batch commits. Whether the
    racer finished within 10 s of that."""
    with psycopg.connect(database_url) as mover:
        assert Store(mover).run(outbox_store.archive_batch(HOT, 10))
        thread = threading.Thread(target=racer)
        thread.start()
        wait_for_lock_waiters(database_url, what)
    thread.join(10)
    return not thread.is_alive()


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


def decided(
    database_url: str,
    registry: Registry,
    key: str | None,
    amount: int = 100,
    *,
    run_id: str,
    reason: str = "",
) -> RecordedDecision:
    """A refund decided under ``key`` in ``run_id`` (its payment named after the key)."""
    with psycopg.connect(database_url) as connection:
        return record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": f"pay_{key}", "amount_cents": amount, "reason": reason},
            run_id=run_id,
            decision_key=key,
        )
