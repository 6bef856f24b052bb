"""roles.sql: each component's group role can run exactly what that component runs.

Every test applies roles.sql to its own database, then connects as LOGIN users made
for it (members of one group role each) and drops them afterwards: roles are
cluster-wide, so nothing of a test may outlive it. The group roles themselves stay,
as they would in a real cluster; without grants in a database they can do nothing
there.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import psycopg.errors
import pytest

from outbox import Operation, Registry
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.models import ApprovalDecision

from support.logins import Login, group_logins
from support.roles_cases import escalated, new_operation, run


@pytest.fixture
def roles_database(database_url: str) -> str:
    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_roles(connection) == outbox_schema.ROLES
    return database_url


@pytest.fixture
def login(postgres_server_url: str, roles_database: str) -> Iterator[Login]:
    """Makes a LOGIN user in one group role; returns its URL for this test's database."""
    with group_logins(postgres_server_url, roles_database) as make:
        yield make


@pytest.fixture
def seeded(roles_database: str, registry: Registry) -> dict[str, Operation]:
    """A prepared operation waiting for an approval (with a denial on it), and an
    escalated one, written by a superuser."""
    waiting = new_operation(roles_database, registry, amount_cents=60_000)
    run(
        roles_database,
        outbox_store.decide_approval(
            waiting.id,
            decision=ApprovalDecision.DENIED,
            approved_by="lead@example.com",
            ttl=timedelta(hours=1),
        ),
    )
    stuck = escalated(roles_database, registry)
    run(
        roles_database,
        outbox_store.record_callback(
            "payments",
            CallbackReport(
                event_id="evt_seed", status=CallbackStatus.PENDING, operation_id=stuck.id
            ),
            "0" * 64,
        ),
    )
    return {"waiting": waiting, "escalated": stuck}
