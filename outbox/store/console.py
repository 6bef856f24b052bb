"""The operator console's reads (``outbox console``): operations a page at a time, and
the approval decisions of one operation.

Pages are cut with a keyset on ``(updated_at, id)``, never with OFFSET: the next page
starts strictly after the last row shown, so reading page 500 costs what page 1 does,
and a row that changes between two pages moves to the top instead of shifting every
later page by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from outbox.models import Approval
from outbox.states import OperationState
from outbox.store.operator import OperationSummary
from outbox.store.runner import Plan, Step


@dataclass(frozen=True)
class Cursor:
    """Where a page ends: the last row's last change and id."""

    updated_at: datetime
    id: UUID


@dataclass(frozen=True)
class OperationFilter:
    states: tuple[OperationState, ...] = ()
    tool: str | None = None
    run_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True)
class OperationPage:
    rows: list[OperationSummary]
    next: Cursor | None
    """Where the following page starts; None on the last page."""


def operations_page(
    where: OperationFilter, *, after: Cursor | None = None, limit: int = 50
) -> Plan[OperationPage]:
    """Up to ``limit`` operations after ``after``, newest change first; never the input."""
    if limit < 1:
        raise ValueError("a page holds at least one operation")
    rows = yield Step(
        "console_operations_page",
        {
            "states": [str(s) for s in where.states] or None,
            "tool": where.tool,
            "run_id": where.run_id,
            "since": where.since,
            "until": where.until,
            "after_updated_at": after.updated_at if after else None,
            "after_id": after.id if after else None,
            # One row more than shown says whether a next page exists, without a count.
            "limit": limit + 1,
        },
    )
    summaries = [OperationSummary.from_row(row) for row in rows[:limit]]
    more = len(rows) > limit
    last = summaries[-1] if summaries else None
    return OperationPage(
        rows=summaries,
        next=Cursor(updated_at=last.updated_at, id=last.id) if more and last else None,
    )


def operation_approvals(operation_id: UUID) -> Plan[list[Approval]]:
    """Every grant and denial of one operation, newest first."""
    rows = yield Step("console_operation_approvals", {"operation_id": operation_id})
    return [Approval.model_validate(row) for row in rows]


@dataclass(frozen=True)
class ConsoleLogin:
    login: str
    operator: bool
    """A member of outbox_operator (a superuser is a member of every role)."""
    superuser: bool


def console_login() -> Plan[ConsoleLogin]:
    """Who the console's database login is, as the roles see it."""
    rows = yield Step("console_login", {})
    row = rows[0]
    return ConsoleLogin(
        login=row["login"], operator=bool(row["operator"]), superuser=bool(row["superuser"])
    )
