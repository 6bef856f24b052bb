"""What the console tests share: counting what an action could write, resolving through
the form, the shorthand for states, reading an operation page's timeline.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from starlette.testclient import TestClient

from outbox import OperationState
from outbox.models import Operation

from support.console_helpers import csrf

S = OperationState
_EVENT_ROW = re.compile(r'<tr id="event-(\d+)">')


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


def timeline_rows(html: str) -> list[int]:
    """The ids of the events an operation page's timeline shows, in order."""
    timeline = html.split('id="timeline"', 1)[1].split("</table>", 1)[0]
    return [int(event_id) for event_id in _EVENT_ROW.findall(timeline)]


def link(html: str, kind: str) -> str | None:
    """Where a page's link of this class goes (``later-events``, ``oldest-events``...)."""
    found = re.search(rf'<a class="{kind}" href="([^"]+)"', html)
    return found.group(1) if found else None
