"""What roles.sql grants: each group exactly its queries' privileges, applied after the
schema, twice without change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import psycopg.errors
import pytest

from outbox import schema as outbox_schema
from outbox.errors import SchemaMissing
from outbox.migrate import SchemaCreatorsRefused, migrate
from outbox.sql import QUERIES, roles_sql

from support.db_helpers import execute_admin
from support.logins import Login
from support.roles_cases import (
    AGENT,
    CALLBACKS,
    COMPONENT_QUERIES,
    CONSUMER,
    DISPATCHER,
    OPERATOR,
    TABLES,
)

OUTBOX = str(Path(sys.executable).parent / "outbox")

# What each group holds, table by table; everything else is refused. Table-level
# privileges here; column grants (which has_table_privilege does not count) below.
GRANTS: dict[str, dict[str, set[str]]] = {
    # The agent writes through outbox_record_decision only; it reads operations through
    # the operation_status view (never the input).
    AGENT: {
        "operation_status": {"SELECT"},
        "outbox_deployment": {"SELECT"},
        # await_outcome of an archived operation: its key's row, which holds no input.
        "history_keys_0": {"SELECT"},
        "history_keys_1": {"SELECT"},
    },
    DISPATCHER: {"outbox": {"SELECT", "DELETE"}},
    CONSUMER: {
        "operations": {"SELECT"},
        "outbox": {"SELECT"},
        "operation_events": {"SELECT"},
        "approvals": {"SELECT"},
        "outbox_deployment": {"SELECT"},
        "callbacks": {"SELECT"},
        # The breaker's row it keeps under a lock (FOR UPDATE needs UPDATE).
        "provider_health": {"SELECT", "UPDATE"},
        # The calls out to a provider with a limit on calls at once: taken, given back.
        "provider_calls": {"SELECT", "INSERT", "DELETE"},
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
        "provider_health": {"SELECT"},
        "provider_events": {"SELECT"},
        "provider_calls": {"SELECT"},
        # The record of discarded dead letters: read, and appended to before a discard.
        "discarded_dead_letters": {"SELECT"},
        # `outbox history status` and `export`, `ops show` of an archived operation.
        "history": {"SELECT"},
        "history_checkpoints": {"SELECT"},
        "history_keys_0": {"SELECT"},
        "history_keys_1": {"SELECT"},
        "history_key_generations": {"SELECT"},
        "history_checkpoint_head": {"SELECT"},
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
        "waiting_since",
    }
)
_APPEND = frozenset({"operation_id", "name", "attributes"})
_QUEUE = frozenset({"operation_id", "routing_key", "available_at"})
COLUMN_GRANTS: dict[str, dict[tuple[str, str], frozenset[str]]] = {
    AGENT: {
        ("operations", "SELECT"): frozenset({"id", "input_fingerprint"}),
        ("approvals", "SELECT"): frozenset(
            {"id", "operation_id", "intent_hash", "decision", "expires_at", "created_at"}
        ),
        # Of history, only what maps an archived operation's id to its decision key.
        ("history", "SELECT"): frozenset({"operation_id", "run_id", "decision_key"}),
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
        # A breaker's row is created by name; its outages appended, never chosen when.
        ("provider_health", "INSERT"): frozenset({"provider"}),
        ("provider_events", "INSERT"): frozenset({"provider", "name", "attributes"}),
        # A call taken again (a redelivery) renews its place's time, nothing else.
        ("provider_calls", "UPDATE"): frozenset({"expires_at"}),
    },
    OPERATOR: {
        ("operations", "UPDATE"): _MOVES,
        ("outbox", "INSERT"): _QUEUE,
        ("operation_events", "INSERT"): _APPEND,
        ("approvals", "INSERT"): frozenset(
            {"id", "operation_id", "intent_hash", "decision", "approved_by", "expires_at"}
        ),
        # Never its id, its login or its time.
        ("discarded_dead_letters", "INSERT"): frozenset(
            {
                "message_id",
                "operation_ids",
                "tools",
                "body_sha256",
                "body_bytes",
                "death_reason",
                "died_at",
                "reason",
                "discarded_by",
            }
        ),
    },
}
PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")


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
    root = Path(__file__).resolve().parents[3] / "roles.sql"

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
    first = outbox_migrate("--roles", "--database-url", database_url)
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
        assert f"schema version {outbox_schema.SCHEMA_VERSION} is applied" in result.stdout
        assert (
            "roles outbox_agent, outbox_dispatcher, outbox_consumer, outbox_operator, "
            "outbox_callbacks are granted" in result.stdout
        )
    assert execute_admin(database_url, *acl) == granted
    held_by = {table: f"{grants} {columns}" for table, grants, columns in granted}
    assert "outbox_agent" in held_by.pop("operation_status")
    # Only migrations read the applied schema's digest: its owner alone holds it.
    assert "outbox_" not in held_by.pop("outbox_schema_applied")
    assert all("outbox_operator" in grants for grants in held_by.values())


def test_the_schema_still_applies_twice_after_the_roles(roles_database: str) -> None:
    for _ in range(2):
        with psycopg.connect(roles_database) as connection:
            assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
            outbox_schema.apply_roles(connection)


def outbox_migrate(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OUTBOX, "migrate", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
        check=False,
    )


PUBLIC_MAY_CREATE = (
    "SELECT count(*) FROM pg_namespace n, aclexplode(n.nspacl) a "
    "WHERE n.oid = current_schema()::regnamespace AND a.grantee = 0 "
    "AND a.privilege_type = 'CREATE'"
)


def test_migrate_with_roles_takes_create_on_the_schema_from_every_role(
    database_url: str,
) -> None:
    # As PostgreSQL 14 and older leave public: every role may create in it.
    schema = execute_admin(database_url, "SELECT current_schema()")[0][0]
    execute_admin(database_url, f'GRANT CREATE ON SCHEMA "{schema}" TO PUBLIC')
    assert execute_admin(database_url, PUBLIC_MAY_CREATE) == [(1,)]

    report = migrate(database_url, roles=True)

    assert execute_admin(database_url, PUBLIC_MAY_CREATE) == [(0,)]
    assert report.schema_creators == ()


def test_migrate_with_roles_stops_for_a_login_that_may_create_in_the_schema(
    login: Login, database_url: str
) -> None:
    agent = urlsplit(login(AGENT)).username
    assert agent is not None
    schema = execute_admin(database_url, "SELECT current_schema()")[0][0]
    execute_admin(database_url, f'GRANT CREATE ON SCHEMA "{schema}" TO PUBLIC, "{agent}"')

    with pytest.raises(SchemaCreatorsRefused, match=agent) as refused:
        migrate(database_url, roles=True)
    assert refused.value.creators == (agent,)
    # Nothing was committed: PUBLIC still holds what the migration would have revoked.
    assert execute_admin(database_url, PUBLIC_MAY_CREATE) == [(1,)]

    cli = outbox_migrate("--roles", "--database-url", database_url)
    assert cli.returncode != 0
    assert agent in cli.stderr
    assert "--allow-schema-creators" in cli.stderr

    allowed = outbox_migrate("--roles", "--allow-schema-creators", "--database-url", database_url)
    assert allowed.returncode == 0, allowed.stderr
    assert "warning: roles other than the schema's owner may still create" in allowed.stderr
    assert agent in allowed.stderr
    assert execute_admin(database_url, PUBLIC_MAY_CREATE) == [(0,)]
