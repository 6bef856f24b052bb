"""The dispatcher's statements: claim unpublished outbox rows, mark them published or
failed, measure the backlog and the operations by state, prune published rows, and
listen for new ones."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple
from uuid import UUID

from outbox.states import OperationState
from outbox.store.runner import Plan, Step

# The channel the outbox insert trigger notifies (schema.sql); listen_outbox_pending
# subscribes to it.
NOTIFY_CHANNEL = "outbox_pending"


class ClaimedRow(NamedTuple):
    """An outbox row locked by this transaction, with what its message needs.

    A NamedTuple rather than a frozen dataclass: one is built per message on the
    dispatcher's hot path, and this is the cheapest immutable record to construct.
    """

    id: int
    operation_id: UUID
    routing_key: str
    traceparent: str | None
    """The decision's W3C trace context, when the row holds a valid one (the claim's own
    SQL checks it: a dispatcher never parses a row's headers)."""
    publish_attempts: int
    """Failed publishes of this row so far."""
    waited_seconds: float
    """How long since the row was written, by the database's clock, at claim time: the
    backoff of failed publishes does not restart it."""
    tool_name: str
    tool_version: int
    input_fingerprint: str


@dataclass(frozen=True)
class FailedPublish:
    outbox_id: int
    error: str
    delay: timedelta


@dataclass(frozen=True)
class Backlog:
    pending: int
    oldest_age_seconds: float


def claim_outbox_batch(batch_size: int) -> Plan[list[ClaimedRow]]:
    """Lock up to ``batch_size`` publishable rows until this transaction ends.

    Claimed by state (``published_at IS NULL``) in id order with SKIP LOCKED, never by
    a high-water mark: ids are assigned before commit, not in commit order.
    """
    rows = yield Step("claim_outbox_batch", {"batch_size": batch_size})
    return [ClaimedRow(**row) for row in rows]


def mark_outbox_published(outbox_ids: list[int]) -> Plan[None]:
    if outbox_ids:
        yield Step("mark_outbox_published", {"ids": outbox_ids})


def mark_outbox_failed(failures: list[FailedPublish]) -> Plan[None]:
    if failures:
        yield Step(
            "mark_outbox_failed",
            {
                "ids": [f.outbox_id for f in failures],
                "errors": [f.error for f in failures],
                "delays": [f.delay for f in failures],
            },
        )


def outbox_backlog() -> Plan[Backlog]:
    rows = yield Step("outbox_backlog", {})
    return Backlog(pending=rows[0]["pending"], oldest_age_seconds=rows[0]["oldest_age_seconds"])


def delete_published_outbox_rows(retention: timedelta, limit: int) -> Plan[int]:
    rows = yield Step("delete_published_outbox_rows", {"retention": retention, "limit": limit})
    return int(rows[0]["deleted"])


def listen_outbox_pending() -> Plan[None]:
    """LISTEN on the channel the outbox insert trigger notifies (autocommit connection)."""
    yield Step("listen_outbox_pending", {})


# Below this many rows (as the statistics count them) committed and rejected are
# counted exactly; above it they are estimated, so that the gauge's pass costs what is
# open rather than the whole history (a count of 2,000,000 rows took 608 ms).
EXACT_SETTLED_COUNT_BELOW = 100_000


def operations_by_state(
    exact_below: int = EXACT_SETTLED_COUNT_BELOW,
) -> Plan[dict[OperationState, int]]:
    """Operations per state, every state present (0 when it has no rows), so a gauge
    set from it drops back to 0 instead of keeping its last non-zero value. Open states
    are exact; committed and rejected are estimated once the table holds
    ``exact_below`` rows or more."""
    size = yield Step("operations_analyzed_rows", {})
    if float(size[0]["analyzed_rows"]) < exact_below:
        rows = yield Step("count_operations_by_state", {})
    else:
        rows = yield Step("operations_by_state", {})
    counts = dict.fromkeys(OperationState, 0)
    counts.update((OperationState(row["state"]), int(row["operations"])) for row in rows)
    return counts
