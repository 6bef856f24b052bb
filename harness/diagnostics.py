"""Statements only :mod:`harness.chaos` runs: ending the daemons' database sessions, and
a snapshot of the sessions as evidence when a run does not settle.

They run on an autocommit psycopg connection of their own, never inside an agent's
or a daemon's transaction, and they touch only the connection's own database.

They are outside :mod:`outbox.store` so that an installed ``outbox`` cannot end
sessions; their SQL stays in ``outbox/sql/queries.sql`` with every other statement.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox.store.runner import Plan, Row, Step, Store


def terminate_backends(connection: psycopg.Connection[Any], application_names: list[str]) -> int:
    """End every session of these applications in the connection's own database; how
    many ended. For the chaos run: another database's sessions, and the caller's own,
    are never touched, because other work shares the server."""
    rows = Store(connection, require_transaction=False).run(_terminate(application_names))
    return int(rows[0]["ended"]) if rows else 0


def session_snapshot(connection: psycopg.Connection[Any]) -> list[str]:
    """Every other session in the connection's own database, one line each: who, in what
    state, how long in its transaction, what it waits for, and the head of its statement
    (parameters are sent apart, so no values). For the chaos run's evidence when a run
    does not settle: a session idle in a transaction for minutes holds locks."""
    rows = Store(connection, require_transaction=False).run(_sessions())
    return [
        f"pid={row['pid']} app={row['application_name'] or '-'} state={row['state']} "
        f"in_transaction_s={row['in_transaction_s']} "
        f"waits={row['wait_event_type'] or '-'}:{row['wait_event'] or '-'} "
        f"query={row['query']!r}"
        for row in rows
    ]


def _terminate(application_names: list[str]) -> Plan[list[Row]]:
    rows = yield Step("terminate_backends", {"application_names": application_names})
    return rows


def _sessions() -> Plan[list[Row]]:
    rows = yield Step("session_snapshot", {})
    return rows
