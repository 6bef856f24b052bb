"""roles.sql: each component's group role can run exactly what that component runs.

Every test applies roles.sql to its own database, then connects as LOGIN users made
for it (members of one group role each) and drops them afterwards: roles are
cluster-wide, so nothing of a test may outlive it. The group roles themselves stay,
as they would in a real cluster; without grants in a database they can do nothing
there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import psycopg.errors
import pytest
from psycopg.types.json import Jsonb
from pydantic import SecretStr

from consumer.worker import Consumer
from dispatcher.daemon import Dispatcher
from outbox import (
    Operation,
    OperationState,
    OutcomeStatus,
    OutcomeWatcher,
    Registry,
    Settings,
    await_outcome,
    await_outcome_sync,
    check_approval,
    grant_approval,
    record_decision,
)
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.broker import OperationMessage
from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.cli import run_command
from outbox.errors import DatabaseError, DecisionConflict, SchemaMissing
from outbox.models import ApprovalDecision, ApprovalStatus, CallbackOutcome
from outbox.sql import QUERIES, roles_sql
from outbox.states import EventName
from outbox.store import Plan, Store

from support.broker_helpers import read_all
from support.db_helpers import execute_admin
from support.dispatch_helpers import counter_value
from support.logins import Login, group_logins
from support.sample_tools import Ledger

S = OperationState
LEASE = timedelta(seconds=60)
AGENT, DISPATCHER, CONSUMER, OPERATOR, CALLBACKS = outbox_schema.ROLES
OUTBOX = str(Path(sys.executable).parent / "outbox")
TABLES = (
    "operation_status",
    "operations",
    "outbox",
    "operation_events",
    "approvals",
    "outbox_schema_version",
    "outbox_deployment",
    "operation_event_heads",
    "callbacks",
)

# Not group roles: `outbox migrate` runs as the schema's owner, and the chaos harness
# (harness/diagnostics.py, not in the wheel) as an administrator of its own database;
# roles.sql grants them nothing.
MIGRATE, CHAOS = "outbox migrate", "python -m harness.chaos"
# `outbox console` runs as outbox_operator too: its reads besides those of `outbox ops`.
# tests/integration/test_console.py runs every page and action as a login that holds
# only that role, which proves the grants cover them.
CONSOLE = "outbox console"

# Which statements of queries.sql each component runs. A query nobody claims fails
# test_every_query_belongs_to_a_component: whoever adds one decides who needs it,
# and the test of that component below proves the grants cover it.
COMPONENT_QUERIES: dict[str, set[str]] = {
    AGENT: {
        "insert_decision",
        "get_operation_by_decision_key",
        "fingerprint_key",
        "listen_operation_changes",
        "operation_outcomes",
        "operation_outcomes_changed",
        "latest_approval",
    },
    DISPATCHER: {
        "listen_outbox_pending",
        "claim_outbox_batch",
        "mark_outbox_published",
        "mark_outbox_failed",
        "outbox_backlog",
        "operations_by_state",
        "delete_published_outbox_rows",
        # The liveness probe of a transaction past its soft deadline.
        "backend_activity",
    },
    CONSUMER: {
        "get_operation",
        "latest_approval",
        "insert_event",
        "get_operations",
        "claim_operations",
        "commit_operations",
        "transition_operation",
        "requeue_stale_prepared",
        "escalate_undeliverable",
        "reject_denied_operations",
        "fingerprint_key",
        "claim_reconciliation_batch",
        "lease_for_reconciliation",
        "defer_reconciliation",
        "schema_is_current",
        "execution_gauges",
        "backend_activity",
        # Applying provider callbacks (consumer/callbacks.py).
        "claim_callback_batch",
        "operation_callbacks",
        "apply_callback",
        "lock_operation",
    },
    OPERATOR: {
        "list_operation_summaries",
        # `ops show op_74ca7733`: the short id the console prints.
        "operation_ids_in_range",
        "get_operation",
        "list_events",
        "list_outbox_rows",
        "latest_approval",
        "transition_operation",
        "list_approval_candidates",
        "insert_approval",
        "count_operations_by_tool_and_state",
        "outbox_backlog",
        "verify_event_chains",
        # Short fingerprints are the keyed ones, and who decided an approval is shown.
        "fingerprint_key",
        "console_operation_approvals",
        # `ops show` lists an operation's callbacks; `outbox callbacks list` the inbox.
        "operation_callbacks",
        "list_callbacks",
    },
    # `outbox callbacks` and record_callback(): one write path, and the catalog at start.
    CALLBACKS: {"record_callback", "schema_is_current"},
    MIGRATE: {
        "database_exists",
        "take_migration_lock",
        "has_schema_version_table",
        "schema_version",
    },
    CHAOS: {"terminate_backends", "session_snapshot"},
    CONSOLE: {"console_login", "console_operations_page", "console_operation_approvals"},
}

# What each group holds, table by table; everything else is refused. Table-level
# privileges here; column grants (which has_table_privilege does not count) below.
GRANTS: dict[str, dict[str, set[str]]] = {
    # The agent writes through outbox_record_decision only; it reads operations through
    # the operation_status view (never the input).
    AGENT: {
        "operation_status": {"SELECT"},
        "outbox_deployment": {"SELECT"},
    },
    DISPATCHER: {"outbox": {"SELECT", "DELETE"}},
    CONSUMER: {
        "operations": {"SELECT"},
        "outbox": {"SELECT"},
        "operation_events": {"SELECT"},
        "approvals": {"SELECT"},
        "outbox_deployment": {"SELECT"},
        "callbacks": {"SELECT"},
    },
    OPERATOR: {
        "operations": {"SELECT"},
        "outbox": {"SELECT"},
        "operation_events": {"SELECT"},
        "approvals": {"SELECT"},
        "outbox_schema_version": {"SELECT"},
        "outbox_deployment": {"SELECT"},
        # `outbox ops verify` compares each chain with its head.
        "operation_event_heads": {"SELECT"},
        "callbacks": {"SELECT"},
    },
    # No table at all: it writes through outbox_record_callback only.
    CALLBACKS: {},
}
# Writes name only the columns a component chooses: never an id, a chain link, a birth
# time, an intent column, a message's routing or headers, or an approval's time.
_MOVES = frozenset(
    {
        "state",
        "attempts",
        "reconcile_attempts",
        "lease_token",
        "lease_owner",
        "lease_expires_at",
        "next_attempt_at",
        "first_attempt_at",
        "provider_reference",
        "result",
        "last_error_class",
        "effect_possible",
    }
)
_APPEND = frozenset({"operation_id", "name", "attributes"})
_QUEUE = frozenset({"operation_id", "routing_key", "available_at"})
COLUMN_GRANTS: dict[str, dict[tuple[str, str], frozenset[str]]] = {
    AGENT: {
        ("operations", "SELECT"): frozenset({"id", "input_fingerprint"}),
        ("operation_events", "INSERT"): _APPEND,
        ("approvals", "SELECT"): frozenset(
            {"id", "operation_id", "intent_hash", "decision", "expires_at", "created_at"}
        ),
    },
    DISPATCHER: {
        ("operations", "SELECT"): frozenset(
            {"id", "state", "tool_name", "tool_version", "input_fingerprint"}
        ),
        ("outbox", "UPDATE"): frozenset(
            {"published_at", "publish_attempts", "last_error", "available_at"}
        ),
    },
    CONSUMER: {
        ("operations", "UPDATE"): _MOVES,
        ("outbox", "INSERT"): _QUEUE,
        ("operation_events", "INSERT"): _APPEND,
        # What it did with a callback; the trigger stamps when, and freezes the rest.
        ("callbacks", "UPDATE"): frozenset({"outcome"}),
    },
    OPERATOR: {
        ("operations", "UPDATE"): _MOVES,
        ("outbox", "INSERT"): _QUEUE,
        ("operation_events", "INSERT"): _APPEND,
        ("approvals", "INSERT"): frozenset(
            {"id", "operation_id", "intent_hash", "decision", "approved_by", "expires_at"}
        ),
    },
}
PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")

# Statements a superuser could run on the seeded data (so "nothing changed" means the
# refusal stopped them), refused to the roles that do not need them.
TAMPER_OPERATION = "UPDATE operations SET last_error_class = 'tampered'"
FORGE_OPERATION = (
    "INSERT INTO operations (id, run_id, tool_name, tool_version, side_effect, input, "
    "input_fingerprint) SELECT gen_random_uuid(), 'forged', tool_name, tool_version, "
    "side_effect, input, input_fingerprint FROM operations"
)
FORGE_OUTBOX_ROW = (
    "INSERT INTO outbox (operation_id, routing_key) SELECT id, 'x.v1' FROM operations"
)
FORGE_EVENT = (
    "INSERT INTO operation_events (operation_id, name) "
    "SELECT id, 'operation.committed' FROM operations"
)
FORGE_APPROVAL = (
    "INSERT INTO approvals (id, operation_id, intent_hash, approved_by, expires_at) "
    "SELECT gen_random_uuid(), id, input_fingerprint, 'mallory', now() + interval '1 day' "
    "FROM operations"
)
MARK_PUBLISHED = "UPDATE outbox SET published_at = now()"
RECORD_CALLBACK = (
    "SELECT * FROM outbox_record_callback('payments', 'evt_forged', 'committed', "
    "(SELECT max(id::text)::uuid FROM operations), NULL, repeat('0', 64))"
)
RECORD_CALLBACK_BLIND = (
    "SELECT * FROM outbox_record_callback('payments', 'evt_forged', 'committed', "
    "gen_random_uuid(), NULL, repeat('0', 64))"
)
RECORD_DECISION_BLIND = (
    "SELECT * FROM outbox_record_decision(gen_random_uuid(), 'forged', NULL, 'send_refund', "
    "1, 'deduplicated_write', '{}', repeat('0', 64), false, '{}')"
)
EVERYONE_REFUSED = [
    # operation_events is evidence: its trigger refuses UPDATE and DELETE, but not
    # TRUNCATE, which fires no row triggers; only the missing grant stops that.
    "UPDATE operation_events SET name = 'operation.committed'",
    "DELETE FROM operation_events",
    "TRUNCATE operation_events",
    "DELETE FROM operations",
    "TRUNCATE operations CASCADE",
    "UPDATE approvals SET expires_at = now() + interval '1 year'",
    "DELETE FROM approvals",
    "DELETE FROM outbox_schema_version",
    # The evidence chain's heads: only the chain trigger (as the owner) writes them.
    "UPDATE operation_event_heads SET events = events + 1",
    "DELETE FROM operation_event_heads",
    "INSERT INTO operation_event_heads SELECT gen_random_uuid(), 1, NULL, '\\x00'",
    # The callbacks inbox: written only by outbox_record_callback, never deleted, and of
    # a row only its outcome is ever set (by the consumer).
    "INSERT INTO callbacks (provider, event_id, status, payload_digest) "
    "VALUES ('payments', 'evt_typed', 'committed', repeat('0', 64))",
    "DELETE FROM callbacks",
    "TRUNCATE callbacks",
    "UPDATE callbacks SET status = 'committed'",
]
REFUSED: dict[str, list[str]] = {
    AGENT: [
        TAMPER_OPERATION,
        FORGE_OPERATION,
        FORGE_OUTBOX_ROW,
        "UPDATE operations SET state = 'in_flight' WHERE state = 'prepared'",
        MARK_PUBLISHED,
        "DELETE FROM outbox",
        "SELECT count(*) FROM outbox",
        "SELECT count(*) FROM operation_events",
        FORGE_APPROVAL,
        RECORD_CALLBACK_BLIND,
    ],
    DISPATCHER: [
        TAMPER_OPERATION,
        "SELECT input FROM operations",
        "SELECT * FROM operations",
        FORGE_OPERATION,
        FORGE_OUTBOX_ROW,
        FORGE_EVENT,
        "SELECT count(*) FROM operation_events",
        "SELECT count(*) FROM approvals",
        FORGE_APPROVAL,
        RECORD_CALLBACK,
    ],
    CONSUMER: [
        FORGE_OPERATION,
        MARK_PUBLISHED,
        "DELETE FROM outbox",
        FORGE_APPROVAL,
        RECORD_CALLBACK,
    ],
    OPERATOR: [FORGE_OPERATION, MARK_PUBLISHED, "DELETE FROM outbox", RECORD_CALLBACK],
    # The callbacks receiver learns nothing of operations and writes nothing but callbacks.
    CALLBACKS: [
        "SELECT count(*) FROM operations",
        "SELECT count(*) FROM operation_status",
        "SELECT count(*) FROM callbacks",
        "SELECT count(*) FROM operation_events",
        "SELECT count(*) FROM outbox",
        "SELECT count(*) FROM approvals",
        "SELECT count(*) FROM outbox_deployment",
        TAMPER_OPERATION,
        FORGE_OPERATION,
        FORGE_OUTBOX_ROW,
        FORGE_EVENT,
        FORGE_APPROVAL,
        MARK_PUBLISHED,
        RECORD_DECISION_BLIND,
        "UPDATE callbacks SET outcome = 'settled'",
    ],
}


# --- fixtures and helpers --------------------------------------------------------------


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


class Ran(logging.Handler):
    """Every statement the store ran in this test, from its DEBUG line per statement
    (logger ``outbox.store``: query name and database user, never parameters). The
    runner is the one place SQL runs, so its lines see every statement a component
    sends, and which user sent it. A handler of its own on that logger: the CLI
    replaces the root logger's handlers, caplog's among them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if vars(record).get("action") == "store.statement":
            self.records.append(record)

    def by(self, user: str | None) -> set[str]:
        return {str(vars(r)["query"]) for r in self.records if vars(r)["user"] == user}


@pytest.fixture
def ran() -> Iterator[Ran]:
    seen = Ran()
    statements = logging.getLogger("outbox.store")
    level = statements.level
    statements.setLevel(logging.DEBUG)
    statements.addHandler(seen)
    try:
        yield seen
    finally:
        statements.removeHandler(seen)
        statements.setLevel(level)


def queries_run_by(ran: Ran, url: str) -> set[str]:
    return ran.by(urlsplit(url).username)


def run(url: str, plan: Plan[Any]) -> Any:
    """One plan in its own committed transaction, connected as ``url``'s user."""
    with psycopg.connect(url) as connection:
        return Store(connection).run(plan)


def snapshot(database_url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every outbox table, as a superuser sees them."""
    return {
        table: execute_admin(database_url, f"SELECT * FROM {table} ORDER BY 1") for table in TABLES
    }


def new_operation(url: str, registry: Registry, amount_cents: int = 100) -> Operation:
    with psycopg.connect(url) as connection:
        recorded = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": f"pay_{uuid.uuid4().hex[:8]}", "amount_cents": amount_cents},
            run_id="run",
        )
    return recorded.operation


def advance(url: str, operation: Operation, *targets: OperationState) -> Operation:
    """Move an operation along legal edges, as ``url``'s user, one commit per edge."""
    for target in targets:
        if target is S.IN_FLIGHT:
            claimed = run(url, outbox_store.claim(operation.id, owner="w", lease=LEASE))
            assert claimed is not None
            operation = claimed
        else:
            operation = run(
                url,
                outbox_store.transition(
                    operation.id,
                    source=operation.state,
                    target=target,
                    lease_token=operation.lease_token,
                    error_class="lookups_unavailable" if target is S.ESCALATED else None,
                ),
            )
    return operation


def escalated(url: str, registry: Registry) -> Operation:
    return advance(url, new_operation(url, registry), S.IN_FLIGHT, S.OUTCOME_UNKNOWN, S.ESCALATED)


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


# --- what roles.sql sets up ----------------------------------------------------------


def test_every_query_belongs_to_a_component() -> None:
    claimed = set().union(*COMPONENT_QUERIES.values())

    assert set(QUERIES) - claimed == set(), "decide which role runs it and grant what it needs"
    assert claimed - set(QUERIES) == set()


def test_each_group_holds_exactly_its_grants_and_public_holds_none(roles_database: str) -> None:
    held = {
        (role, table, privilege)
        for role in outbox_schema.ROLES
        for table in TABLES
        for privilege in PRIVILEGES
        if execute_admin(
            roles_database, "SELECT has_table_privilege(%s, %s, %s)", (role, table, privilege)
        )[0][0]
    }
    columns = execute_admin(
        roles_database,
        "SELECT g.rolname, c.relname, p.privilege_type, array_agg(a.attname::text) "
        "FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 "
        "CROSS JOIN LATERAL aclexplode(a.attacl) p JOIN pg_roles g ON g.oid = p.grantee "
        "WHERE c.relname = ANY(%s) GROUP BY 1, 2, 3",
        (list(TABLES),),
    )
    public = execute_admin(
        roles_database,
        "SELECT c.relname, a.privilege_type FROM pg_class c, aclexplode(c.relacl) a "
        "WHERE c.relname = ANY(%s) AND a.grantee = 0",
        (list(TABLES),),
    )
    groups = execute_admin(
        roles_database,
        "SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls "
        "FROM pg_roles WHERE rolname = ANY(%s) ORDER BY rolname",
        (list(outbox_schema.ROLES),),
    )
    temporary = execute_admin(
        roles_database,
        "SELECT a.privilege_type FROM pg_database d, aclexplode(d.datacl) a "
        "WHERE d.datname = current_database() AND a.grantee = 0",
    )

    assert held == {
        (role, table, privilege)
        for role, tables in GRANTS.items()
        for table, privileges in tables.items()
        for privilege in privileges
    }
    assert {
        (role, table, privilege): frozenset(names) for role, table, privilege, names in columns
    } == {
        (role, table, privilege): names
        for role, granted in COLUMN_GRANTS.items()
        for (table, privilege), names in granted.items()
    }
    assert public == []
    assert "TEMPORARY" not in {privilege for (privilege,) in temporary}
    assert groups == [
        (role, False, False, False, False, False) for role in sorted(outbox_schema.ROLES)
    ]


def test_the_roles_need_the_schema_first(empty_database_url: str) -> None:
    with psycopg.connect(empty_database_url) as connection, pytest.raises(SchemaMissing):
        outbox_schema.apply_roles(connection)


def test_roles_sql_is_the_file_at_the_repository_root() -> None:
    root = Path(__file__).resolve().parents[2] / "roles.sql"

    assert roles_sql() == root.read_text(encoding="utf-8")


def test_migrate_with_roles_applies_twice_and_changes_nothing_the_second_time(
    database_url: str,
) -> None:
    acl = (
        "SELECT c.relname, c.relacl::text, "
        "       array_agg(a.attname || '=' || a.attacl::text ORDER BY a.attnum) "
        "       FILTER (WHERE a.attacl IS NOT NULL) "
        "FROM pg_class c LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 "
        "WHERE c.relname = ANY(%s) GROUP BY c.relname, c.relacl::text ORDER BY c.relname",
        (list(TABLES),),
    )
    first = subprocess.run(
        [OUTBOX, "migrate", "--roles", "--database-url", database_url],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
        check=False,
    )
    granted = execute_admin(database_url, *acl)
    second = subprocess.run(
        [OUTBOX, "migrate", "--roles"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OUTBOX_DATABASE_URL": database_url},
        check=False,
    )

    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    for result in (first, second):
        assert "schema version 7 is applied" in result.stdout
        assert (
            "roles outbox_agent, outbox_dispatcher, outbox_consumer, outbox_operator, "
            "outbox_callbacks are granted" in result.stdout
        )
    assert execute_admin(database_url, *acl) == granted
    held_by = {table: f"{grants} {columns}" for table, grants, columns in granted}
    assert "outbox_agent" in held_by.pop("operation_status")
    assert all("outbox_operator" in grants for grants in held_by.values())


def test_the_schema_still_applies_twice_after_the_roles(roles_database: str) -> None:
    for _ in range(2):
        with psycopg.connect(roles_database) as connection:
            assert outbox_schema.apply_schema(connection) == 7
            outbox_schema.apply_roles(connection)


# --- each component does its job with its own role --------------------------------


def test_the_agent_records_decisions_and_reads_them_back(
    login: Login, registry: Registry, roles_database: str, ran: Ran
) -> None:
    agent = login(AGENT)
    refund = {"payment_id": "pay_1", "amount_cents": 100}

    with psycopg.connect(agent) as connection:
        first = record_decision(
            connection, registry, "send_refund", refund, run_id="r", decision_key="k"
        )
    with psycopg.connect(agent) as connection:
        again = record_decision(
            connection, registry, "send_refund", refund, run_id="r", decision_key="k"
        )
    with psycopg.connect(agent) as connection, pytest.raises(DecisionConflict):
        record_decision(
            connection,
            registry,
            "send_refund",
            {**refund, "amount_cents": 101},
            run_id="r",
            decision_key="k",
        )

    # The agent learns how its decisions stand: running, or waiting for a person.
    with psycopg.connect(agent) as connection:
        large = record_decision(
            connection,
            registry,
            "send_refund",
            {**refund, "amount_cents": 60_000},
            run_id="r",
            decision_key="large",
        )
    running = await_outcome_sync(agent, first, timeout=0)
    waiting = asyncio.run(await_outcome(agent, large, timeout=0))
    with psycopg.connect(agent) as connection:
        approval = check_approval(connection, large.operation.id)

    assert (first.created, again.created) == (True, False)
    assert again.operation.id == first.operation.id
    assert (running.status, waiting.status) == ("pending", "awaiting_approval")
    assert approval.status is ApprovalStatus.MISSING
    assert execute_admin(roles_database, "SELECT state FROM operations") == [
        ("prepared",),
        ("prepared",),
    ]
    assert execute_admin(roles_database, "SELECT count(*) FROM outbox") == [(2,)]
    assert execute_admin(roles_database, "SELECT name FROM operation_events") == [
        ("operation.prepared",),
        ("operation.prepared",),
    ]
    assert queries_run_by(ran, agent) == COMPONENT_QUERIES[AGENT]


async def test_the_agent_awaits_an_approval_an_operator_grants(
    login: Login, registry: Registry, ran: Ran
) -> None:
    agent, operator = login(AGENT), login(OPERATOR)
    with psycopg.connect(agent) as connection:
        large = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 60_000},
            run_id="r",
            decision_key="large",
        )

    async with OutcomeWatcher(agent, poll_interval=0.2) as watcher:
        before = await watcher.wait(large, timeout=0)
        with psycopg.connect(operator) as connection:
            grant_approval(
                connection, large.operation.id, approved_by="lead", ttl=timedelta(hours=1)
            )
        after = await watcher.wait(large, timeout=0)

    assert before.status is OutcomeStatus.AWAITING_APPROVAL
    assert (before.approval, before.reason) == (ApprovalStatus.MISSING, "approval_missing")
    assert (after.status, after.approval) == (OutcomeStatus.PENDING, ApprovalStatus.VALID)
    assert {"listen_operation_changes", "operation_outcomes_changed"} <= queries_run_by(ran, agent)


async def test_the_dispatcher_publishes_what_the_agent_recorded(
    login: Login,
    registry: Registry,
    roles_database: str,
    settings: Settings,
    amqp_server_url: str,
    ran: Ran,
) -> None:
    agent, dispatcher_url = login(AGENT), login(DISPATCHER)
    recorded = [new_operation(agent, registry) for _ in range(3)]
    dispatcher = Dispatcher(settings.model_copy(update={"database_url": SecretStr(dispatcher_url)}))

    report = await dispatcher.drain()
    messages = await read_all(amqp_server_url, settings.queue, expect=3)
    async with await psycopg.AsyncConnection.connect(dispatcher_url) as database:
        backlog = await dispatcher.refresh_backlog(database)
    async with await psycopg.AsyncConnection.connect(dispatcher_url, autocommit=True) as listener:
        await (await outbox_store.AsyncStore.on(listener, require_transaction=False)).run(
            outbox_store.listen_outbox_pending()
        )
    await dispatcher.prune()  # under the default retention: nothing is old enough yet
    # A publish that failed, then retention with no grace: the dispatcher's other writes.
    ((first_row,),) = execute_admin(roles_database, "SELECT min(id) FROM outbox")
    failed = outbox_store.FailedPublish(first_row, "broker said no", timedelta(0))
    run(dispatcher_url, outbox_store.mark_outbox_failed([failed]))
    deleted = run(dispatcher_url, outbox_store.delete_published_outbox_rows(timedelta(0), 10))
    # A batch past its soft deadline: is the server working on it? Its own backends only.
    with psycopg.connect(dispatcher_url) as watched:
        pid = watched.info.backend_pid
        assert pid in run(dispatcher_url, outbox_store.backend_activity())

    assert (report.published, report.failed) == (3, 0)
    assert sorted(m.body.operation_id for m in messages) == sorted(o.id for o in recorded)
    assert backlog.pending == 0
    assert deleted == 3
    assert execute_admin(roles_database, "SELECT count(*) FROM outbox") == [(0,)]
    assert queries_run_by(ran, dispatcher_url) == COMPONENT_QUERIES[DISPATCHER]


def test_the_consumer_executes_reconciles_and_escalates(
    login: Login, registry: Registry, roles_database: str, ran: Ran
) -> None:
    consumer = login(CONSUMER)
    waiting = new_operation(roles_database, registry, amount_cents=60_000)
    executed = new_operation(roles_database, registry)
    unknown = advance(roles_database, new_operation(roles_database, registry), S.IN_FLIGHT)
    unknown = advance(roles_database, unknown, S.OUTCOME_UNKNOWN)
    stale = new_operation(roles_database, registry)
    execute_admin(
        roles_database,
        "UPDATE outbox SET published_at = now() - interval '1 hour' WHERE operation_id = %s",
        (stale.id,),
    )

    # At start: is the schema there? The catalog answers without a grant.
    with psycopg.connect(consumer) as connection:
        assert outbox_schema.schema_is_current(connection)
    # The key of the short fingerprints its spans show.
    assert len(run(consumer, outbox_store.fingerprint_key())) == 64
    # A message arrives: load, check the approval, note the wait.
    assert run(consumer, outbox_store.find_operation(waiting.id)) == waiting
    check = run(consumer, outbox_store.check_approval(waiting.id))
    assert check.status is ApprovalStatus.MISSING
    run(consumer, outbox_store.append_event(waiting, EventName.APPROVAL_REQUIRED, {}))
    # Its gauges of what waits: to be executed, and for an approval.
    assert run(consumer, outbox_store.execution_gauges()).awaiting_approval == 1
    # Its liveness probe sees its own backends, state included, without a grant.
    with psycopg.connect(consumer) as watched:
        watched.execute("SELECT 1")
        activity = run(consumer, outbox_store.backend_activity())
        assert activity[watched.info.backend_pid][0] == "idle in transaction"
    # Claim and execute: prepared -> in_flight -> committed.
    committed = advance(consumer, executed, S.IN_FLIGHT, S.COMMITTED)
    # The reconciler: requeue a lost message, lease an unknown outcome, defer a lookup,
    # then give up on it: outcome_unknown -> escalated.
    requeued = run(consumer, outbox_store.requeue_stale_prepared(timedelta(0), 10))
    # ... and end what nothing would move: escalate what keeps coming back undelivered,
    # reject what was denied and never granted.
    execute_admin(
        roles_database,
        "UPDATE outbox SET published_at = now() - interval '1 hour' WHERE operation_id = %s",
        (stale.id,),
    )
    # A consumer without its tool refused the requeued message: the evidence.
    run(consumer, outbox_store.append_event(stale, EventName.DEAD_LETTERED, {"reason": "x"}))
    assert run(consumer, outbox_store.escalate_undeliverable(timedelta(0), 1, 10)) == [
        (stale.id, "send_refund")
    ]
    assert run(consumer, outbox_store.reject_denied_operations(timedelta(hours=1), 10)) == []
    with psycopg.connect(consumer) as connection:
        runner = Store(connection)
        (due,) = runner.run(outbox_store.claim_reconciliation_batch(10))
        leased = runner.run(outbox_store.lease_for_reconciliation(due, owner="r", lease=LEASE))
        assert leased is not None
        runner.run(
            outbox_store.defer_reconciliation(
                leased.id, lease_token=leased.lease_token, reason="lookup_failed", delay=LEASE
            )
        )
    gave_up = advance(consumer, run(consumer, outbox_store.get_operation(unknown.id)), S.ESCALATED)
    # A burst of deliveries: loaded, claimed and committed together.
    burst = new_operation(roles_database, registry)
    assert run(consumer, outbox_store.find_operations([burst.id])) == {burst.id: burst}
    (claimed,) = run(consumer, outbox_store.claim_many([(burst.id, LEASE)], owner="w")).values()
    effect = outbox_store.ConfirmedEffect(
        operation=claimed, provider_reference="re_burst", result={}, attributes={}
    )
    assert run(consumer, outbox_store.commit_many([effect]))[burst.id].state is S.COMMITTED
    # A provider's callback about it: claimed with its operation, read under the
    # operation's lock, applied once.
    run(
        roles_database,
        outbox_store.record_callback(
            "payments",
            CallbackReport(
                event_id="evt_1",
                status=CallbackStatus.COMMITTED,
                operation_id=burst.id,
                provider_reference="re_burst",
            ),
            "0" * 64,
        ),
    )
    with psycopg.connect(consumer) as connection:
        runner = Store(connection)
        (callback,) = runner.run(outbox_store.claim_callback_batch(["send_refund.v1"], 10))
        locked = runner.run(outbox_store.lock_operation(burst.id))
        assert locked is not None
        assert runner.run(outbox_store.callbacks_of([burst.id])) == {burst.id: [callback]}
        runner.run(outbox_store.mark_callback(callback, CallbackOutcome.CONFIRMED))
    assert execute_admin(roles_database, "SELECT outcome FROM callbacks") == [("confirmed",)]

    assert committed.state is S.COMMITTED
    assert requeued == [stale.id]
    assert due.id == unknown.id
    assert gave_up.state is S.ESCALATED
    assert queries_run_by(ran, consumer) == COMPONENT_QUERIES[CONSUMER]


def test_the_callbacks_receiver_records_callbacks_and_nothing_else(
    login: Login, registry: Registry, roles_database: str, ran: Ran
) -> None:
    receiver = login(CALLBACKS)
    operation = new_operation(roles_database, registry)
    before = execute_admin(roles_database, "SELECT state, lease_token FROM operations")

    with psycopg.connect(receiver) as connection:
        assert outbox_schema.schema_is_current(connection)
    report = CallbackReport(
        event_id="evt_1", status=CallbackStatus.COMMITTED, operation_id=operation.id
    )
    first = run(receiver, outbox_store.record_callback("payments", report, "a" * 64))
    again = run(receiver, outbox_store.record_callback("payments", report, "a" * 64))
    stranger = CallbackReport(event_id="evt_2", status=CallbackStatus.REJECTED)
    unmatched = run(receiver, outbox_store.record_callback("payments", stranger, "b" * 64))

    assert (first.result, again.result, unmatched.result) == ("recorded", "duplicate", "unmatched")
    assert execute_admin(roles_database, "SELECT state, lease_token FROM operations") == before
    assert run(roles_database, outbox_store.verify_chain(operation.id)).intact
    assert queries_run_by(ran, receiver) == COMPONENT_QUERIES[CALLBACKS]


@pytest.mark.parametrize("target", [S.COMMITTED, S.REJECTED, S.PREPARED])
def test_the_consumer_cannot_resolve_an_escalation(
    login: Login, roles_database: str, seeded: dict[str, Operation], target: OperationState
) -> None:
    consumer = login(CONSUMER)
    operation = seeded["escalated"]
    before = snapshot(roles_database)

    with pytest.raises(DatabaseError) as refused:
        run(consumer, outbox_store.transition(operation.id, source=S.ESCALATED, target=target))

    assert type(refused.value) is DatabaseError
    assert isinstance(refused.value.driver_error, psycopg.errors.InsufficientPrivilege)
    assert "operations_escalation_operator_only" in str(refused.value)
    assert "only a member of outbox_operator may resolve it" in str(
        refused.value.driver_error.diag.message_primary
    )
    assert snapshot(roles_database) == before


def test_the_operator_resolves_escalations_and_decides_approvals(
    login: Login,
    roles_database: str,
    seeded: dict[str, Operation],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ran: Ran,
) -> None:
    operator = login(OPERATOR)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", operator)
    waiting, stuck = seeded["waiting"], seeded["escalated"]

    codes = [
        run_command(["ops", "list"]),
        run_command(["ops", "show", stuck.display_id[:11]]),
        # What waits for approval shows its check and who decided (latest_approval,
        # console_operation_approvals); `approvals pending` reads both in one statement.
        run_command(["ops", "show", waiting.display_id]),
        run_command(["ops", "verify", stuck.display_id]),
        run_command(["ops", "verify", "--all"]),
        run_command(["stats"]),
        run_command(["approvals", "pending"]),
        run_command(
            [
                "ops",
                "resolve",
                stuck.display_id,
                "--committed",
                "--provider-ref",
                "re_found",
                "--evidence",
                "seen on the provider dashboard",
                "--by",
                "oncall@example.com",
            ]
        ),
        run_command(["approvals", "grant", waiting.display_id, "--by", "lead@example.com"]),
        run_command(["callbacks", "list", "--unmatched"]),
    ]
    rows = run(operator, outbox_store.outbox_rows(waiting.id))

    assert codes == [0] * len(codes), capsys.readouterr().err
    assert run(roles_database, outbox_store.get_operation(stuck.id)).state is S.COMMITTED
    assert run(roles_database, outbox_store.check_approval(waiting.id)).is_valid
    assert len(rows) == 2  # the decision's row and the one the grant queued
    assert queries_run_by(ran, operator) == COMPONENT_QUERIES[OPERATOR]


# --- and nothing more ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "statement"),
    [(group, statement) for group in outbox_schema.ROLES for statement in EVERYONE_REFUSED]
    + [(group, statement) for group, statements in REFUSED.items() for statement in statements],
)
def test_a_role_is_refused_what_its_component_never_does(
    login: Login, roles_database: str, seeded: dict[str, Operation], group: str, statement: str
) -> None:
    user = login(group)
    before = snapshot(roles_database)

    # "permission denied": the grant refused it, not a trigger further down (the
    # append-only trigger raises the same SQLSTATE).
    with (
        psycopg.connect(user) as connection,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match=r"^permission denied for "),
    ):
        connection.execute(statement)

    assert snapshot(roles_database) == before


def test_the_agent_cannot_mark_an_operation_committed(
    login: Login, roles_database: str, registry: Registry
) -> None:
    agent = login(AGENT)
    claimed = advance(roles_database, new_operation(agent, registry), S.IN_FLIGHT)
    before = snapshot(roles_database)

    with pytest.raises(DatabaseError) as refused:
        run(
            agent,
            outbox_store.transition(
                claimed.id,
                source=S.IN_FLIGHT,
                target=S.COMMITTED,
                lease_token=claimed.lease_token,
                provider_reference="re_forged",
            ),
        )

    assert isinstance(refused.value.driver_error, psycopg.errors.InsufficientPrivilege)
    assert snapshot(roles_database) == before


@pytest.mark.parametrize("group", [AGENT, DISPATCHER, CONSUMER])
def test_only_the_operator_grants_approvals(
    login: Login, roles_database: str, seeded: dict[str, Operation], group: str
) -> None:
    user = login(group)
    before = snapshot(roles_database)

    with pytest.raises(DatabaseError) as refused:
        run(
            user,
            outbox_store.decide_approval(
                seeded["waiting"].id,
                decision=ApprovalDecision.GRANTED,
                approved_by="mallory",
                ttl=timedelta(days=1),
            ),
        )

    assert isinstance(refused.value.driver_error, psycopg.errors.InsufficientPrivilege)
    assert snapshot(roles_database) == before


# --- attacks on the trust boundaries ------------------------------------------------


def forged_refund_arguments(operation_id: uuid.UUID, amount_cents: int) -> dict[str, Any]:
    """A refund decision written around the library: no approval asked for, and a
    fingerprint that is not the input's."""
    return {
        "id": operation_id,
        "run_id": "forged",
        "decision_key": None,
        "tool_name": "send_refund",
        "tool_version": 1,
        "side_effect": "deduplicated_write",
        "input": Jsonb({"payment_id": "pay_forged", "amount_cents": amount_cents}),
        "input_fingerprint": "0" * 64,
        "requires_approval": False,
        "headers": Jsonb({}),
    }


RECORD_DIRECTLY = (
    "SELECT * FROM outbox_record_decision(%(id)s, %(run_id)s, %(decision_key)s, "
    "%(tool_name)s, %(tool_version)s, %(side_effect)s, %(input)s, %(input_fingerprint)s, "
    "%(requires_approval)s, %(headers)s)"
)


async def test_a_refund_forged_by_the_agent_role_is_escalated_as_tampering_never_paid(
    login: Login, roles_database: str, registry: Registry, ledger: Ledger, settings: Settings
) -> None:
    agent, consumer_user = login(AGENT), login(CONSUMER)
    forged = uuid.uuid4()
    # 60,000 cents needs an approval; the forged row says it does not. The database
    # cannot recompute a fingerprint, so it accepts the row through the agent's path.
    with psycopg.connect(agent) as connection:
        connection.execute(RECORD_DIRECTLY, forged_refund_arguments(forged, 60_000))
    row = run(roles_database, outbox_store.get_operation(forged))
    consumer = Consumer(
        settings.model_copy(update={"database_url": SecretStr(consumer_user)}), registry
    )
    envelope = OperationMessage(
        operation_id=forged,
        outbox_id=1,
        tool="send_refund",
        tool_version=1,
        input_fingerprint=row.input_fingerprint,
    )
    try:
        verdict = await consumer.claim(envelope)
    finally:
        await consumer.close()

    assert getattr(verdict, "result", None) == "tampered"
    assert ledger.calls == []
    final = run(roles_database, outbox_store.get_operation(forged))
    assert final.state is S.ESCALATED
    events = run(roles_database, outbox_store.events(forged))
    assert [(e.name, e.attributes.get("check")) for e in events[-2:]] == [
        ("operation.tampered", "fingerprint_mismatch"),
        ("operation.escalated", "fingerprint_mismatch"),
    ]
    assert events[-1].attributes["reason"] == "tampered"
    assert (
        counter_value(
            consumer,
            "outbox_consumer_tampered_total",
            tool="send_refund",
            check="fingerprint_mismatch",
        )
        == 1
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("state", "'committed'"),
        ("provider_reference", "'re_forged'"),
        ("attempts", "1"),
        ("result", "'{}'::jsonb"),
    ],
)
def test_no_role_not_even_the_owner_inserts_an_operation_that_looks_executed(
    roles_database: str, field: str, value: str
) -> None:
    before = snapshot(roles_database)

    with (
        psycopg.connect(roles_database) as connection,
        pytest.raises(psycopg.errors.CheckViolation, match="must be prepared"),
    ):
        connection.execute(
            f"INSERT INTO operations (id, run_id, tool_name, tool_version, side_effect, "
            f"input, input_fingerprint, {field}) VALUES (gen_random_uuid(), 'forged', "
            f"'send_refund', 1, 'deduplicated_write', '{{}}', repeat('0', 64), {value})"
        )

    assert snapshot(roles_database) == before


@pytest.mark.parametrize(
    "name", ["operation.resolved", "operation.committed", "operation.prepared"]
)
def test_the_agent_appends_no_event_but_its_own(
    login: Login, roles_database: str, seeded: dict[str, Operation], name: str
) -> None:
    agent = login(AGENT)
    before = snapshot(roles_database)

    with (
        psycopg.connect(agent) as connection,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match="may not append"),
    ):
        connection.execute(
            "INSERT INTO operation_events (operation_id, name, attributes) VALUES (%s, %s, %s)",
            (seeded["escalated"].id, name, Jsonb({"by": "mallory", "decision": "rejected"})),
        )

    assert snapshot(roles_database) == before


def test_the_agent_may_append_agent_completed(
    login: Login, roles_database: str, seeded: dict[str, Operation]
) -> None:
    agent = login(AGENT)

    with psycopg.connect(agent) as connection:
        connection.execute(
            "INSERT INTO operation_events (operation_id, name) VALUES (%s, 'agent.completed')",
            (seeded["waiting"].id,),
        )

    names = [e.name for e in run(roles_database, outbox_store.events(seeded["waiting"].id))]
    assert names[-1] == "agent.completed"


def test_the_agent_appends_to_the_evidence_chain_without_choosing_its_link(
    login: Login, roles_database: str, seeded: dict[str, Operation]
) -> None:
    """The chain trigger runs as the owner: the agent needs no grant on the heads, and no
    INSERT of a role names the link (its grant is on the columns an append chooses); the
    trigger writes the real one."""
    agent = login(AGENT)

    with psycopg.connect(agent) as connection:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute(
                "INSERT INTO operation_events (operation_id, name, seq, prev_hash, hash) "
                "VALUES (%s, 'agent.completed', 1, NULL, '\\x00')",
                (seeded["waiting"].id,),
            )
        connection.rollback()
        connection.execute(
            "INSERT INTO operation_events (operation_id, name) VALUES (%s, 'agent.completed')",
            (seeded["waiting"].id,),
        )

    report = run(roles_database, outbox_store.verify_chain(seeded["waiting"].id))
    assert report.intact
    events = run(roles_database, outbox_store.events(seeded["waiting"].id))
    assert report.events_checked == len(events)


@pytest.mark.parametrize("group", outbox_schema.ROLES)
def test_no_role_hangs_the_chain_trigger_on_a_table_of_its_own(
    login: Login, roles_database: str, seeded: dict[str, Operation], group: str
) -> None:
    """outbox_chain_event runs as the owner; a trigger of a role's own (on a temporary
    table) could move any operation's head with it. Creating one needs EXECUTE, which
    nobody holds. (roles.sql revokes temporary tables too; this login has them back, as
    a deployment's may, to show the missing EXECUTE holds on its own.)"""
    user = login(group, temporary=True)
    before = snapshot(roles_database)

    with psycopg.connect(user) as connection:
        connection.execute(
            "CREATE TEMP TABLE forged (operation_id uuid, id bigint, name text, "
            "attributes jsonb, created_at timestamptz, seq integer, prev_hash bytea, hash bytea)"
        )
        with pytest.raises(
            psycopg.errors.InsufficientPrivilege, match="permission denied for function"
        ):
            connection.execute(
                "CREATE TRIGGER forge BEFORE INSERT ON forged "
                "FOR EACH ROW EXECUTE FUNCTION outbox_chain_event()"
            )

    assert snapshot(roles_database) == before


@pytest.mark.parametrize("name", ["operation.resolved", "operation.prepared"])
def test_the_consumer_appends_no_event_only_a_person_or_the_agent_path_writes(
    login: Login, roles_database: str, seeded: dict[str, Operation], name: str
) -> None:
    consumer = login(CONSUMER)
    before = snapshot(roles_database)

    with (
        psycopg.connect(consumer) as connection,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match="may not append"),
    ):
        connection.execute(
            "INSERT INTO operation_events (operation_id, name) VALUES (%s, %s)",
            (seeded["escalated"].id, name),
        )

    assert snapshot(roles_database) == before


@pytest.mark.parametrize("group", [CONSUMER, OPERATOR, None])
@pytest.mark.parametrize(
    "change",
    [
        'input = \'{"payment_id": "pay_other", "amount_cents": 60000}\'::jsonb',
        "requires_approval = false",
        "input_fingerprint = repeat('0', 64)",
        "tool_name = 'send_email'",
        "side_effect = 'idempotent_write'",
    ],
)
def test_nobody_rewrites_a_recorded_intent(
    login: Login, roles_database: str, seeded: dict[str, Operation], group: str | None, change: str
) -> None:
    user = login(group) if group else roles_database  # None: the owner, a superuser here
    before = snapshot(roles_database)
    # A component's UPDATE grant names no intent column; the owner, who may update any
    # column, meets the trigger that freezes the intent for everyone.
    refusal = "permission denied for table operations" if group else "intent"

    with (
        psycopg.connect(user) as connection,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match=refusal),
    ):
        connection.execute(
            f"UPDATE operations SET {change} WHERE id = %s",
            (seeded["waiting"].id,),
        )

    assert snapshot(roles_database) == before
