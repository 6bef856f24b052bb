"""The schema against a role that plays tricks: search paths, shadowed catalogs, chosen
event ids, backdated or future times.
"""

from __future__ import annotations

import re
from datetime import timedelta
from urllib.parse import urlsplit

import psycopg
import psycopg.errors
import pytest

from outbox import Registry
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.models import ApprovalDecision

from support.db_helpers import execute_admin
from support.hostile_cases import (
    AGENT,
    CONSUMER,
    DISPATCHER,
    OPERATOR,
    S,
    decide,
    events_of,
    record_as,
    refund,
    refused,
)
from support.logins import Login
from support.ops_helpers import Ops

# --- functions that cannot be fooled ---------------------------------------------------


def test_every_function_of_the_schema_pins_its_search_path(database_url: str) -> None:
    rows = execute_admin(
        database_url,
        "SELECT p.proname, p.prosqlbody IS NOT NULL, p.proconfig FROM pg_proc p "
        "WHERE p.pronamespace = current_schema()::regnamespace ORDER BY 1",
    )

    unpinned = []
    for name, standard_body, config in rows:
        if standard_body:
            continue  # bound at creation: no name in it is looked up at run time
        # Not the schema itself: a role that may create there could define an operator
        # that fits an expression better than the built-in one.
        if "search_path=pg_catalog, pg_temp" not in (config or []):
            unpinned.append(name)
    assert {name for name, *_ in rows} >= {
        "outbox_guard_transition",
        "outbox_guard_event_names",
        "outbox_chain_event",
        "outbox_record_decision",
        "outbox_record_callback",
        "outbox_guard_callback",
    }
    assert unpinned == []


STRING_LITERAL = re.compile(r"'(?:[^']|'')*'")
LINE_COMMENT = re.compile(r"--[^\n]*")


def test_no_function_body_names_an_object_of_the_schema_without_its_schema(
    database_url: str,
) -> None:
    # Their search_path holds pg_catalog alone, so an unqualified table or function of
    # the schema would fail at run time, on whichever path first reaches it.
    names = {
        name
        for (name,) in execute_admin(
            database_url,
            "SELECT c.relname FROM pg_class c "
            "WHERE c.relnamespace = current_schema()::regnamespace "
            "AND c.relkind IN ('r', 'v', 'S', 'p') "
            "UNION SELECT p.proname FROM pg_proc p "
            "WHERE p.pronamespace = current_schema()::regnamespace",
        )
    }
    bodies = execute_admin(
        database_url,
        "SELECT p.proname, p.prosrc FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
        "WHERE p.pronamespace = current_schema()::regnamespace AND l.lanname = 'plpgsql'",
    )
    unqualified = re.compile(r"(?<![.\w\"])(" + "|".join(sorted(names)) + r")\b")

    found = {}
    for function, body in bodies:
        code = STRING_LITERAL.sub("''", LINE_COMMENT.sub("", body))
        named = sorted(set(unqualified.findall(code)))
        if named:
            found[function] = named
    assert {"operations", "operation_events", "outbox_plausible_time"} <= names
    assert len(bodies) >= 10
    assert found == {}


def test_an_operator_created_in_the_schema_never_runs_as_the_tables_owner(
    login: Login, database_url: str, registry: Registry
) -> None:
    # Where every role may create in the schema (PostgreSQL 14 and older by default, and
    # databases upgraded with pg_upgrade), as granted here to one agent login: text ||
    # integer fits this operator better than the built-in text || anynonarray, and
    # outbox_record_decision (SECURITY DEFINER) writes the routing key with exactly that.
    agent = login(AGENT)
    schema = execute_admin(database_url, "SELECT current_schema()")[0][0]
    execute_admin(
        database_url,
        f'GRANT CREATE ON SCHEMA "{schema}" TO "{urlsplit(agent).username}"',
    )
    with psycopg.connect(agent, autocommit=True) as connection:
        connection.execute(f'CREATE TABLE "{schema}".hijacked (ran_as text, login text)')
        connection.execute(f'GRANT INSERT ON "{schema}".hijacked TO PUBLIC')
        connection.execute(
            f'CREATE FUNCTION "{schema}".hijack(a text, b integer) RETURNS text '
            "LANGUAGE plpgsql AS $$ BEGIN "
            f'INSERT INTO "{schema}".hijacked VALUES (current_user, session_user); '
            "RETURN a || b::text; END $$"
        )
        connection.execute(
            f'CREATE OPERATOR "{schema}".|| (LEFTARG = text, RIGHTARG = integer, '
            f'FUNCTION = "{schema}".hijack)'
        )
        # The operator works, for whoever calls it in their own statements.
        assert connection.execute("SELECT 'a' || 1").fetchone() == ("a1",)
        connection.execute(f'TRUNCATE "{schema}".hijacked')

    operation = record_as(agent, registry, refund())

    assert execute_admin(database_url, "SELECT ran_as, login FROM hijacked") == []
    assert execute_admin(
        database_url, "SELECT routing_key FROM outbox WHERE operation_id = %s", (operation.id,)
    ) == [("send_refund.v1",)]


def test_no_login_may_create_a_temporary_table(login: Login) -> None:
    for group in outbox_schema.ROLES:
        error = refused(login(group), "CREATE TEMP TABLE pg_roles (rolname name)")
        assert isinstance(error, psycopg.errors.InsufficientPrivilege)


@pytest.mark.parametrize("name", ["operation.resolved", "operation.approval_granted"])
def test_a_shadowed_catalog_does_not_let_the_agent_write_what_only_people_write(
    login: Login, database_url: str, registry: Registry, name: str
) -> None:
    # TEMPORARY granted back, as a deployment may: the pinned search_path holds alone.
    agent = login(AGENT, temporary=True)
    operation = record_as(database_url, registry, refund())

    with psycopg.connect(agent) as connection:
        connection.execute("CREATE TEMP TABLE pg_roles (rolname name)")
        connection.execute("CREATE TEMP TABLE pg_class (oid oid, relowner oid)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute(
                "INSERT INTO operation_events (operation_id, name, attributes) "
                'VALUES (%s, %s, \'{"by": "ceo@example.com", "decision": "committed"}\')',
                (operation.id, name),
            )

    assert [n for n, _ in events_of(database_url, operation.id)] == ["operation.prepared"]


def test_a_shadowed_catalog_does_not_let_the_consumer_resolve_an_escalation(
    login: Login, database_url: str, ops: Ops
) -> None:
    consumer = login(CONSUMER, temporary=True)
    escalated = ops.at(S.ESCALATED)

    with psycopg.connect(consumer, autocommit=True) as connection:
        connection.execute("CREATE TEMP TABLE pg_roles (rolname name)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute(
                "UPDATE operations SET state = 'committed', provider_reference = 're_forged' "
                "WHERE id = %s",
                (escalated.id,),
            )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute(
                "INSERT INTO operation_events (operation_id, name, attributes) "
                "VALUES (%s, 'operation.resolved', '{\"decision\": \"committed\"}')",
                (escalated.id,),
            )

    assert ops.get(escalated.id).state is S.ESCALATED
    assert "operation.resolved" not in ops.event_names(escalated.id)


# --- column grants: no role chooses an identity, a link or a time ----------------------


@pytest.mark.parametrize("group", [AGENT, CONSUMER, OPERATOR])
def test_no_role_chooses_an_event_id_and_decisions_keep_being_recorded(
    login: Login, database_url: str, registry: Registry, group: str
) -> None:
    attacker = login(group)
    victim = record_as(database_url, registry, refund())
    next_id = execute_admin(database_url, "SELECT max(id) + 1 FROM operation_events")[0][0]

    error = refused(
        attacker,
        "INSERT INTO operation_events (id, operation_id, name) OVERRIDING SYSTEM VALUE "
        "SELECT g, %s, 'agent.completed' FROM generate_series(%s, %s + 400) g "
        "ON CONFLICT DO NOTHING",
        (victim.id, next_id, next_id),
    )

    assert isinstance(error, psycopg.errors.InsufficientPrivilege)
    # The ids it aimed at are free: the next decision, grant and outcome write succeed.
    agent = login(AGENT)
    recorded = record_as(agent, registry, refund(amount_cents=60_000))
    approval = decide(
        Ops(database_url, registry), recorded.id, ApprovalDecision.GRANTED, timedelta(hours=1)
    )
    assert approval.operation_id == recorded.id


def test_an_event_whose_id_collides_is_still_inserted_and_the_chain_stays_intact(
    database_url: str, ops: Ops
) -> None:
    """The owner may still name an id; the chain trigger draws a fresh one, so the head
    moves exactly for the rows that are inserted ("INSERT 0 0" used to move it)."""
    operation = ops.new()
    taken = execute_admin(database_url, "SELECT min(id) FROM operation_events")[0][0]

    with psycopg.connect(database_url) as connection:
        inserted = connection.execute(
            "INSERT INTO operation_events (id, operation_id, name) OVERRIDING SYSTEM VALUE "
            "VALUES (%s, %s, 'agent.completed') ON CONFLICT DO NOTHING",
            (taken, operation.id),
        ).rowcount

    assert inserted == 1
    assert [n for n, _ in events_of(database_url, operation.id)] == [
        "operation.prepared",
        "agent.completed",
    ]
    assert ops.run(outbox_store.verify_chain()).intact


def test_no_writer_backdates_an_event(login: Login, database_url: str, ops: Ops) -> None:
    operation = ops.new()
    error = refused(
        login(AGENT),
        "INSERT INTO operation_events (operation_id, name, created_at) "
        "VALUES (%s, 'agent.completed', '2001-01-01')",
        (operation.id,),
    )
    with psycopg.connect(database_url) as connection:
        connection.execute(
            "INSERT INTO operation_events (operation_id, name, created_at) "
            "VALUES (%s, 'agent.completed', '2001-01-01')",
            (operation.id,),
        )

    assert isinstance(error, psycopg.errors.InsufficientPrivilege)
    ages = execute_admin(
        database_url,
        "SELECT extract(epoch FROM clock_timestamp() - created_at) FROM operation_events "
        "WHERE operation_id = %s AND name = 'agent.completed'",
        (operation.id,),
    )
    assert len(ages) == 1
    assert 0 <= ages[0][0] < 600


def test_the_dispatcher_cannot_rewrite_what_a_message_is_made_of(
    login: Login, database_url: str, ops: Ops
) -> None:
    dispatcher = login(DISPATCHER)
    ops.new()
    for statement in (
        "UPDATE outbox SET routing_key = 'elsewhere.v1'",
        "UPDATE outbox SET headers = '{\"x\": 1}'",
        "UPDATE outbox SET operation_id = gen_random_uuid()",
        "UPDATE outbox SET available_at = 'infinity'",
        "UPDATE outbox SET published_at = now() + interval '5 years'",
    ):
        error = refused(dispatcher, statement)
        assert isinstance(
            error, psycopg.errors.InsufficientPrivilege | psycopg.errors.CheckViolation
        ), statement
    assert execute_admin(database_url, "SELECT routing_key, published_at FROM outbox") == [
        ("send_refund.v1", None)
    ]


def test_no_role_writes_a_time_that_never_comes(login: Login, ops: Ops) -> None:
    consumer = login(CONSUMER)
    in_flight = ops.at(S.IN_FLIGHT)
    prepared = ops.new()
    statements = [
        ("UPDATE operations SET lease_expires_at = 'infinity' WHERE id = %s", in_flight.id),
        (
            "UPDATE operations SET next_attempt_at = now() + interval '400 years' WHERE id = %s",
            prepared.id,
        ),
        (
            "INSERT INTO outbox (operation_id, routing_key, available_at) "
            "VALUES (%s, 'send_refund.v1', 'infinity')",
            prepared.id,
        ),
        ("UPDATE operations SET created_at = '2001-01-01' WHERE id = %s", prepared.id),
    ]
    for statement, operation_id in statements:
        error = refused(consumer, statement, (operation_id,))
        assert isinstance(
            error, psycopg.errors.CheckViolation | psycopg.errors.InsufficientPrivilege
        ), statement
    assert ops.get(in_flight.id).lease_expires_at == in_flight.lease_expires_at
