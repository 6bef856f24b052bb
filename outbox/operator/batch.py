"""Resolve many escalations at once: the ones a filter selects (tool, escalation reason,
run, escalated-at range), each settled exactly as ``outbox ops resolve OP_ID`` settles
one, by :func:`outbox.operator.rules.resolve`. ``outbox ops resolve`` over a filter and
the console's batch form both come here.

A batch is bounded (:data:`MAX_BATCH`), selected once (oldest escalation first) and
resolved as selected: an operation escalated after the selection is not in it, and a
second run picks up what one left. Each operation gets its own transaction, so a refusal
(it moved since the selection, its tool's dedupe window passed) is reported for that
operation and the batch goes on; each ``operation.resolved`` event carries the batch's
id. ``committed`` is not offered in a batch: it needs each operation's own provider
reference, which one command cannot carry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import psycopg

from outbox import store
from outbox.contracts import Registry
from outbox.errors import IllegalTransition, InputRefused, OutboxError
from outbox.models import display_operation_id
from outbox.operator import input as person_input
from outbox.operator import rules
from outbox.operator.rules import Resolution, Resolved
from outbox.store import EscalationFilter, EscalationSelection, Store

DEFAULT_BATCH = 500
# The most one batch resolves: one command's worth of a person's judgement. More than
# this matching waits for another run, which the report says.
MAX_BATCH = 1000
# Longer than any tool name, reason or run id the runtime writes.
MAX_FILTER_TEXT = 200
# What a batch may do: committed needs a provider reference per operation.
BATCH_RESOLUTIONS = (Resolution.REJECTED, Resolution.NOT_COMMITTED)


def batch_resolution(resolution: Resolution) -> Resolution:
    if resolution not in BATCH_RESOLUTIONS:
        raise InputRefused(
            "a batch resolves as rejected or not_committed only: committed needs each "
            "operation's own provider reference, so resolve those one at a time"
        )
    return resolution


def batch_limit(limit: int | None) -> int:
    chosen = DEFAULT_BATCH if limit is None else limit
    if not 1 <= chosen <= MAX_BATCH:
        raise InputRefused(f"a batch is 1 to {MAX_BATCH} operations; run again for more")
    return chosen


def checked_filter(where: EscalationFilter) -> EscalationFilter:
    """The filter as given, or a refusal: at least one condition (a batch never takes
    every escalation by accident), and text a person could have typed."""
    if where.is_empty:
        raise InputRefused(
            "select the escalations by tool, reason, run or escalation time: a batch never "
            "takes every escalation without a condition"
        )
    for name in ("tool", "reason", "run_id"):
        value = getattr(where, name)
        if value is not None and (
            not value.strip() or len(value) > MAX_FILTER_TEXT or person_input.has_controls(value)
        ):
            raise InputRefused(
                f"{name}: 1 to {MAX_FILTER_TEXT} characters, and no control characters"
            )
    return where


def select(runner: Store, where: EscalationFilter, limit: int | None) -> EscalationSelection:
    """The escalations a batch would resolve: at most ``limit`` (``DEFAULT_BATCH``
    without one), oldest escalation first, with how many match in all."""
    return runner.run(store.escalations_matching(checked_filter(where), limit=batch_limit(limit)))


def digest(selection: EscalationSelection) -> str:
    """A name for exactly these operations: a preview's confirmation carries it, and is
    refused if the same filter selects anything else by then."""
    ids = sorted(str(e.operation.id) for e in selection.escalations)
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()


def pinned(where: EscalationFilter, selected_at: datetime) -> EscalationFilter:
    """The filter with its window closed at ``selected_at``: run again, it selects none
    of the operations escalated since (a relative start becomes the instant it meant)."""
    since = where.since
    if since is not None and not isinstance(since, datetime):
        since = selected_at - since
    until = where.until
    if until is not None and not isinstance(until, datetime):
        until = selected_at - until
    return replace(
        where, since=since, until=selected_at if until is None else min(until, selected_at)
    )


def confirmed(
    runner: Store, where: EscalationFilter, limit: int | None, selected_at: datetime, shown: str
) -> EscalationSelection:
    """The selection a preview showed, read again with its window closed where the
    preview's closed; refused, with nothing changed, if it is not the same operations."""
    # Judged as given: the closed window is not a condition the person chose.
    again = select(runner, pinned(checked_filter(where), selected_at), limit)
    if digest(again) != shown:
        raise IllegalTransition(
            f"the escalations this filter selects changed since the preview ({again.matched} "
            "match now): some were resolved, or moved, meanwhile. Preview again; nothing "
            "was changed"
        )
    return again


@dataclass(frozen=True)
class Refused:
    operation_id: UUID
    display_id: str
    why: str


@dataclass
class BatchReport:
    batch_id: UUID
    resolution: Resolution
    by: str
    matched: int
    selected: int
    resolved: list[Resolved] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    stopped: str | None = None
    """Why the batch stopped before its end (the database went away), or None."""

    @property
    def left_out(self) -> int:
        """Matching operations beyond the batch's bound: the next run's."""
        return self.matched - self.selected

    @property
    def not_tried(self) -> int:
        return self.selected - len(self.resolved) - len(self.refused)


def resolve_selected(
    connection: psycopg.Connection[Any],
    selection: EscalationSelection,
    resolution: Resolution,
    *,
    by: str,
    evidence: str | None,
    registry: Registry | None,
) -> BatchReport:
    """Resolve each selected operation through :func:`outbox.operator.rules.resolve`,
    in a transaction of its own on ``connection`` (whose open transaction, the
    selection's, ends first). The decision and the evidence are judged once, before
    anything is written."""
    batch_resolution(resolution)
    kept = person_input.evidence(evidence)
    connection.commit()
    runner = Store(connection)
    report = BatchReport(
        batch_id=uuid4(),
        resolution=resolution,
        by=by,
        matched=selection.matched,
        selected=len(selection.escalations),
    )
    for escalation in selection.escalations:
        summary = escalation.operation
        try:
            resolved = rules.resolve(
                runner,
                summary.id,
                resolution,
                by=by,
                evidence=kept,
                provider_reference=None,
                force=False,
                registry=registry,
                batch_id=report.batch_id,
            )
            connection.commit()
        except (OutboxError, psycopg.Error) as error:
            if connection.broken:
                report.stopped = f"the database connection broke ({type(error).__name__})"
                break
            connection.rollback()
            why = (
                str(error).removesuffix("; nothing was changed")
                if isinstance(error, OutboxError)
                else f"database error (SQLSTATE {error.sqlstate})"
            )
            report.refused.append(Refused(summary.id, display_operation_id(summary.id), why))
            continue
        report.resolved.append(resolved)
    return report
