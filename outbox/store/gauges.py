"""What waits to be executed, for the consumer's gauges (run by the consumer), and who
the daemons' and migrations' sessions wait for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from outbox.store.runner import Plan, Step


@dataclass(frozen=True)
class ExecutionBacklog:
    oldest_ready_age_seconds: float
    """How long the oldest operation ready to execute has waited (0 when none): prepared,
    due, its message published, and not waiting for an approval. It is the consumers'
    to claim; anything else holding it back has a gauge of its own."""
    awaiting_approval: int
    """Prepared operations whose latest event is the consumer's approval wait or a
    denial: the consumer's own verdict, not the stored flag alone."""


def execution_gauges() -> Plan[ExecutionBacklog]:
    rows = yield Step("execution_gauges", {})
    return ExecutionBacklog(
        oldest_ready_age_seconds=float(rows[0]["oldest_ready_age_seconds"]),
        awaiting_approval=int(rows[0]["awaiting_approval"]),
    )


@dataclass(frozen=True)
class LockHolder:
    """Another session holding a lock someone waits for: a migration, or a daemon's
    statement. Its state and times are NULL in ``pg_stat_activity`` for a login that
    may not read that session's (another role's, without ``pg_read_all_stats``):
    "unknown" and 0 here."""

    pid: int
    role: str
    state: str
    seconds: int
    """How long its transaction has been open (or its session, outside one)."""

    def __str__(self) -> str:
        return f"pid {self.pid} (role {self.role}, {self.state}, for {self.seconds} s)"


def schema_lock_holders() -> Plan[tuple[LockHolder, ...]]:
    """The other sessions holding a lock on a table of the connection's schema, longest
    open first (at most five): who a migration that timed out waited for."""
    rows = yield Step("schema_lock_holders", {})
    return _holders(rows)


def lock_blockers(pid: int) -> Plan[tuple[LockHolder, ...]]:
    """The sessions backend ``pid`` waits for, if it waits for a lock (at most five,
    longest open first); none when it waits for nothing."""
    rows = yield Step("lock_blockers", {"pid": pid})
    return _holders(rows)


def _holders(rows: Sequence[Mapping[str, Any]]) -> tuple[LockHolder, ...]:
    return tuple(
        LockHolder(
            pid=int(row["pid"]),
            role=str(row["role"]),
            state=str(row["state"] or "unknown"),
            seconds=int(row["seconds"] or 0),
        )
        for row in rows
    )


def backend_activity() -> Plan[dict[int, tuple[str, float]]]:
    """This login's other backends: each one's state (``pg_stat_activity.state``) and
    how long it has been in it, for the liveness probe (run by both daemons)."""
    rows = yield Step("backend_activity", {})
    return {int(row["pid"]): (str(row["state"]), float(row["idle_for"])) for row in rows}
