"""What waits to be executed, for the consumer's gauges (run by the consumer)."""

from __future__ import annotations

from dataclasses import dataclass

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


def backend_activity() -> Plan[dict[int, tuple[str, float]]]:
    """This login's other backends: each one's state (``pg_stat_activity.state``) and
    how long it has been in it, for the liveness probe (run by both daemons)."""
    rows = yield Step("backend_activity", {})
    return {int(row["pid"]): (str(row["state"]), float(row["idle_for"])) for row in rows}
