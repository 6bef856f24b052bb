"""What the console tests share: counting what an action could write, resolving through
the form, the shorthand for states.
"""

from __future__ import annotations

from typing import Any

import psycopg
from starlette.testclient import TestClient

from outbox import OperationState
from outbox.models import Operation

from support.console_helpers import csrf

S = OperationState


def counts(database_url: str) -> dict[str, int]:
    """Everything an action could write, as committed."""
    with psycopg.connect(database_url, autocommit=True) as connection:
        row = connection.execute(
            "SELECT (SELECT count(*) FROM operation_events), (SELECT count(*) FROM approvals),"
            " (SELECT count(*) FROM outbox),"
            " (SELECT string_agg(state, ',' ORDER BY id) FROM operations)"
        ).fetchone()
    assert row is not None
    return {"events": row[0], "approvals": row[1], "outbox": row[2], "states": row[3]}


def resolve(browser: TestClient, op: Operation, **form: str) -> Any:
    token = csrf(browser, f"/operations/{op.display_id}")
    return browser.post(f"/operations/{op.display_id}/resolve", data={"csrf_token": token, **form})
