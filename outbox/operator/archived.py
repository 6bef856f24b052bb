"""What ``outbox ops show`` and ``outbox ops list --archived`` read of operations that
moved to history (docs/operating.md, "History retention"): an archived operation is
shown as a hot one is, from its ``history`` row, its timeline a page at a time, with
when it settled and when it moved; a listing with ``--archived`` merges the newest
archived operations into the hot ones, under the same limit. The hot tables are always
read first: history is asked only for what they no longer hold.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from outbox import store
from outbox.cli.run import print_json
from outbox.errors import OperationNotFound
from outbox.models import ApprovalCheck
from outbox.operator import one_operation
from outbox.operator.render import approval_text, instant, stamp
from outbox.states import OperationState
from outbox.store import ArchivedOperation, OperationSummary, Store
from outbox.store.approvals import approval_check

# Only a settled operation ever moves: a listing of other states asks history nothing.
ARCHIVED_STATES = frozenset({OperationState.COMMITTED, OperationState.REJECTED})


def archived_text(archived: ArchivedOperation) -> str:
    """When it settled and when it moved, in one line."""
    return (
        f"yes: settled {stamp(archived.settled_at)}, moved to history "
        f"{stamp(archived.archived_at)}; read from history, where nothing of it changes"
    )


def archived_json(archived: ArchivedOperation) -> dict[str, Any]:
    return {
        "settled_on": archived.settled_on.isoformat(),
        "settled_at": instant(archived.settled_at),
        "archived_at": instant(archived.archived_at),
        "events": archived.event_count,
    }


def approval_when_settled(archived: ArchivedOperation, key: str) -> ApprovalCheck | None:
    """The approval check as it stood when the operation settled (its latest decision
    then, judged at that moment); None when its contract asked for none."""
    operation = archived.operation
    if not operation.requires_approval:
        return None
    latest = archived.approvals[-1] if archived.approvals else None
    return approval_check(
        latest, fingerprint=operation.input_fingerprint, now=archived.settled_at, key=key
    )


def show(runner: Store, operation_id: UUID, args: argparse.Namespace) -> int:
    """``ops show`` of an operation only history holds: exit 0, or OperationNotFound
    when history does not hold it either."""
    archived = runner.run(store.archived_facts(operation_id))
    if archived is None:
        raise OperationNotFound(f"no operation with id {operation_id}")
    key = runner.run(store.fingerprint_key())
    page = runner.run(
        store.archived_events_page(
            operation_id, after_id=args.after, before_id=args.before, limit=args.events
        )
    )
    check = approval_when_settled(archived, key)
    decided_by = check.approval.approved_by if check and check.approval else None
    operation = archived.operation
    if args.json:
        print_json(
            one_operation.show_json(
                operation,
                page,
                check,
                decided_by,
                key,
                archived.callbacks,
                archived=archived_json(archived),
            )
        )
        return 0
    approval = (
        f"{approval_text(check, decided_by)} (when it settled)" if check is not None else None
    )
    print(
        one_operation.show_text(
            operation, page, approval, key, archived.callbacks, archived=archived_text(archived)
        )
    )
    return 0


@dataclass(frozen=True)
class Listing:
    """``ops list``: the operations shown, newest change first, and when each archived
    one moved (absent: the hot tables hold it)."""

    summaries: list[OperationSummary]
    archived_at: dict[UUID, datetime]


def listing(
    runner: Store,
    hot: list[OperationSummary],
    *,
    states: Sequence[OperationState] | None,
    tool: str | None,
    since: datetime | None,
    within: timedelta | None,
    limit: int,
) -> Listing:
    """``hot`` (at most ``limit``, newest first) and the newest archived operations that
    match the same filter, merged and cut to ``limit``."""
    wanted = [s for s in states or ARCHIVED_STATES if s in ARCHIVED_STATES]
    if not wanted:
        return Listing(summaries=hot, archived_at={})
    found = runner.run(
        store.archived_summaries(
            states=list(states) if states else None,
            tool=tool,
            since=since,
            within=within,
            limit=limit,
        )
    )
    archived_at = {a.summary.id: a.archived_at for a in found}
    # An operation moved between the two reads is in both: shown once, as archived.
    merged = [s for s in hot if s.id not in archived_at] + [a.summary for a in found]
    merged.sort(key=lambda s: (-s.updated_at.timestamp(), s.id))
    shown = merged[:limit]
    return Listing(
        summaries=shown,
        archived_at={s.id: archived_at[s.id] for s in shown if s.id in archived_at},
    )
