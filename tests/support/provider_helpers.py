"""Provider breakers as the operator views read them, written straight into a test's
database as the tables' owner (the consumer's own writes are tested with the consumer),
and operations made to wait for their provider the way the consumer does it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg

from outbox import Operation
from outbox import store as outbox_store
from outbox.store import Store


def put_provider(
    database_url: str,
    provider: str,
    *,
    state: str = "open",
    down_for: timedelta | None = timedelta(minutes=12),
    probes: int = 0,
    next_probe_in: timedelta | None = None,
    probe_owner: str | None = None,
    not_before_in: timedelta | None = None,
    last_failure: str | None = "connect_failed",
    failing: Sequence[Any] = (),
) -> None:
    """A ``provider_health`` row; times are offsets from the database's clock. A closed
    breaker has no outage (the table's CHECK says so)."""
    _execute(
        database_url,
        """
        INSERT INTO provider_health (
            provider, state, failing_operations, failing_since, last_failure,
            outage_started_at, opened_at, probes, next_probe_at, probe_owner,
            probe_expires_at, not_before)
        SELECT %(provider)s, %(state)s, %(failing)s::uuid[],
               CASE WHEN cardinality(%(failing)s::uuid[]) > 0
                    THEN now() - interval '5 seconds' END,
               %(last_failure)s,
               now() - %(down_for)s::interval,
               now() - %(down_for)s::interval + interval '10 seconds',
               %(probes)s,
               now() + %(next_probe_in)s::interval,
               %(probe_owner)s,
               CASE WHEN %(probe_owner)s::text IS NOT NULL THEN now() + interval '30 seconds' END,
               now() + %(not_before_in)s::interval
        """,
        {
            "provider": provider,
            "state": state,
            "failing": list(failing),
            "last_failure": last_failure,
            "down_for": down_for if state != "closed" else None,
            "probes": probes,
            "next_probe_in": next_probe_in,
            "probe_owner": probe_owner,
            "not_before_in": not_before_in,
        },
    )


def put_event(
    database_url: str, provider: str, name: str, attributes: dict[str, Any], *, ago: timedelta
) -> int:
    """A ``provider_events`` row ``ago`` before now; returns its id."""
    [(event_id,)] = _execute(
        database_url,
        "INSERT INTO provider_events (provider, name, attributes, created_at) "
        "VALUES (%(provider)s, %(name)s, %(attributes)s::jsonb, now() - %(ago)s::interval) "
        "RETURNING id",
        {"provider": provider, "name": name, "attributes": json.dumps(attributes), "ago": ago},
    )
    return int(event_id)


def wait_for_provider(database_url: str, operations: Sequence[Operation], provider: str) -> None:
    """Prepared operations held back by their provider's breaker, as the consumer holds
    them: due again in ten minutes, waiting since now, no attempt counted."""
    with psycopg.connect(database_url) as connection:
        moved = Store(connection).run(
            outbox_store.wait_prepared(
                [(operation, timedelta(minutes=10)) for operation in operations],
                provider=provider,
                reason="provider_unavailable",
            )
        )
    assert set(moved) == {operation.id for operation in operations}


def _execute(database_url: str, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        cursor = connection.execute(sql, params)
        return cursor.fetchall() if cursor.description else []
