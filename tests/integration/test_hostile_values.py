"""Every value a role can write is hostile: the attacks of the hostile-values issue, each
made as a LOGIN user that holds one group role only (or, for what no role can do any
more, as the tables' owner writing around the bounds, as a row from before them would
be), and what the database, the daemons and every operator view do with it.

A role controls only the values its grant names, and every reader survives any value a
role can write (docs/design.md section 7)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import psycopg.errors
import pytest
from psycopg.types.json import Jsonb

from outbox import Operation, OperationState, Registry, Settings, record_decision
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.bounds import MAX_INPUT_BYTES, MAX_PROVIDER_REFERENCE, unreadable_reason
from outbox.cli import run_command
from outbox.fingerprint import canonical_json, intent_fingerprint
from outbox.fingerprint_key import keyed_fingerprint
from outbox.intent import derive_intent
from outbox.models import Approval, ApprovalDecision, ApprovalStatus
from outbox.store import Store

from support.broker_helpers import read_all
from support.console_helpers import client, console, console_settings, logged_in
from support.consume_helpers import in_state, running_consumer
from support.db_helpers import execute_admin
from support.dispatch_helpers import all_published, counter_value, running_dispatcher
from support.logins import Login, group_logins
from support.ops_helpers import Ops
from support.sample_tools import Ledger
from support.waiting import eventually

S = OperationState
AGENT, DISPATCHER, CONSUMER, OPERATOR, CALLBACKS = outbox_schema.ROLES
DEEP = "[" * 2000 + "]" * 2000
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
RECORD_DECISION = (
    "SELECT id FROM outbox_record_decision(%s, %s, %s, 'send_refund', 1, "
    "'deduplicated_write', %s::jsonb, %s, false, %s::jsonb)"
)


@pytest.fixture
def login(postgres_server_url: str, database_url: str) -> Iterator[Login]:
    with group_logins(postgres_server_url, database_url) as make:
        yield make


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def refund(amount_cents: int = 100, **more: Any) -> dict[str, Any]:
    return {"payment_id": f"pay_{uuid.uuid4().hex[:8]}", "amount_cents": amount_cents, **more}


def record_as(url: str, registry: Registry, tool_input: dict[str, Any]) -> Operation:
    with psycopg.connect(url) as connection:
        return record_decision(
            connection, registry, "send_refund", tool_input, run_id="r"
        ).operation


def fingerprint_of(tool_input: dict[str, Any]) -> str:
    return intent_fingerprint("send_refund", 1, tool_input)


def refused(url: str, statement: str, params: Any = None) -> psycopg.Error:
    """Run ``statement`` as ``url``'s user; it must be refused. Returns the error."""
    with psycopg.connect(url) as connection:
        try:
            connection.execute(statement, params)
        except psycopg.Error as error:
            return error
    raise AssertionError(f"the database accepted: {statement}")


def with_trigger_off(
    database_url: str, table: str, trigger: str, statement: str, params: Any
) -> None:
    """What only the tables' owner (or a superuser) can do, and a row from before the
    bounds would look like: write around one trigger, inside one transaction."""
    with psycopg.connect(database_url) as connection:
        connection.execute(f"ALTER TABLE {table} DISABLE TRIGGER {trigger}")
        connection.execute(statement, params)
        connection.execute(f"ALTER TABLE {table} ENABLE TRIGGER {trigger}")


def poison_input(database_url: str, operation_id: UUID, field: str = "payment_id") -> None:
    """An input nested deeper than any parser goes, as a row from before the bounds."""
    with_trigger_off(
        database_url,
        "operations",
        "operations_guard_transition",
        "UPDATE operations SET input = jsonb_build_object(%s::text, %s::jsonb) WHERE id = %s",
        (field, DEEP, operation_id),
    )


def poison_event(database_url: str, operation_id: UUID) -> None:
    """An agent.completed event whose attributes nest deeper than any parser goes."""
    with_trigger_off(
        database_url,
        "operation_events",
        "operation_events_by_role",
        "INSERT INTO operation_events (operation_id, name, attributes) "
        "VALUES (%s, 'agent.completed', jsonb_build_object('outcome', %s::jsonb))",
        (operation_id, DEEP),
    )


def decide(
    ops: Ops,
    operation_id: UUID,
    decision: ApprovalDecision,
    ttl: timedelta = timedelta(minutes=15),
) -> Approval:
    """A person's grant or denial, through the store, as lead@example.com."""
    approval: Approval = ops.run(
        outbox_store.decide_approval(
            operation_id, decision=decision, approved_by="lead@example.com", ttl=ttl
        )
    )
    return approval


def events_of(database_url: str, operation_id: UUID) -> list[tuple[str, Any]]:
    rows = execute_admin(
        database_url,
        "SELECT name, attributes FROM operation_events WHERE operation_id = %s ORDER BY seq",
        (operation_id,),
    )
    return [(str(name), attributes) for name, attributes in rows]


def cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], url: str, *argv: str
) -> str:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    code = run_command(list(argv))
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err
    return captured.out


# --- functions that cannot be fooled ---------------------------------------------------


def test_every_function_of_the_schema_pins_its_search_path(database_url: str) -> None:
    rows = execute_admin(
        database_url,
        "SELECT p.proname, p.prosqlbody IS NOT NULL, p.proconfig FROM pg_proc p "
        "WHERE p.pronamespace = current_schema()::regnamespace ORDER BY 1",
    )
    schema = execute_admin(database_url, "SELECT current_schema()")[0][0]

    unpinned = []
    for name, standard_body, config in rows:
        if standard_body:
            continue  # bound at creation: no name in it is looked up at run time
        paths = [
            c.removeprefix("search_path=") for c in config or [] if c.startswith("search_path=")
        ]
        elements = [e.strip() for e in paths[0].split(",")] if paths else []
        if (
            not elements
            or elements[-1] != "pg_temp"
            or not set(elements) <= {schema, "pg_catalog", "pg_temp"}
        ):
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


# --- bounds in the database, the same as in Python -------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        DEEP,
        json.dumps({"traceparent": "0" * 300_000}),
        json.dumps({"traceparent": TRACEPARENT, "x-forwarded": "1"}),
        json.dumps({"traceparent": {"nested": TRACEPARENT}}),
        json.dumps(["not", "an", "object"]),
    ],
    ids=["deep", "huge-traceparent", "other-header", "not-a-string", "array"],
)
def test_the_agents_write_path_refuses_headers_other_than_a_trace_context(
    login: Login, database_url: str, headers: str
) -> None:
    agent = login(AGENT)
    tool_input = refund()
    before = execute_admin(database_url, "SELECT count(*) FROM operations")

    error = refused(
        agent,
        RECORD_DECISION,
        (
            uuid.uuid4(),
            "run_poison",
            "k1",
            Jsonb(tool_input),
            fingerprint_of(tool_input),
            Jsonb(json.loads(headers)) if headers != DEEP else headers,
        ),
    )

    assert isinstance(error, psycopg.errors.CheckViolation)
    assert error.diag.constraint_name == "outbox_row_bounded"
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == before


def test_a_valid_trace_context_still_travels(login: Login, database_url: str) -> None:
    tool_input = refund()
    with psycopg.connect(login(AGENT)) as connection:
        connection.execute(
            RECORD_DECISION,
            (
                uuid.uuid4(),
                "r",
                "k",
                Jsonb(tool_input),
                fingerprint_of(tool_input),
                Jsonb({"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}),
            ),
        )
    assert execute_admin(database_url, "SELECT headers->>'traceparent' FROM outbox") == [
        (TRACEPARENT,)
    ]


@pytest.mark.parametrize(
    "tool_input",
    [
        json.dumps({"payment_id": "pay_1", "amount_cents": 1, "reason": "x" * (20 * 1024 * 1024)}),
        '{"payment_id": "pay_1", "amount_cents": 1, "reason": ' + DEEP + "}",
        '["pay_1", 1]',
    ],
    ids=["20MB", "deep", "array"],
)
def test_the_agents_write_path_refuses_input_outside_the_bounds(
    login: Login, database_url: str, tool_input: str
) -> None:
    error = refused(
        login(AGENT),
        RECORD_DECISION,
        (uuid.uuid4(), "r", "k", tool_input, "e" * 64, Jsonb({})),
    )

    assert isinstance(error, psycopg.errors.CheckViolation)
    assert error.diag.constraint_name == "operations_input_bounded"
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == [(0,)]


def test_the_prepared_event_carries_only_what_the_runtime_knows(
    login: Login, database_url: str, registry: Registry
) -> None:
    agent = login(AGENT)
    tool_input = refund()
    # Before version 6 the caller passed the event's attributes: that signature is gone.
    error = refused(
        agent,
        "SELECT id FROM outbox_record_decision(%s, 'r', 'k', 'send_refund', 1, "
        "'deduplicated_write', %s, %s, false, '{}', %s)",
        (
            uuid.uuid4(),
            Jsonb(tool_input),
            fingerprint_of(tool_input),
            Jsonb({"operation.resolved by": "ceo@example.com"}),
        ),
    )
    operation = record_as(agent, registry, refund())

    assert isinstance(error, psycopg.errors.UndefinedFunction)
    assert events_of(database_url, operation.id) == [
        ("operation.prepared", {"tool": "send_refund", "tool_version": 1, "run_id": "r"})
    ]


@pytest.mark.parametrize(
    "attributes",
    [
        '{"agent.outcome": ' + DEEP + "}",
        json.dumps({"outcome": "refund_confirmed"}),
        json.dumps({"operation.resolved by": "ceo@example.com"}),
        json.dumps({"agent.note": "x" * 5000}),
    ],
    ids=["deep", "outside-namespace", "runtime-like-key", "too-large"],
)
def test_the_agents_events_are_its_own_words_and_bounded(
    login: Login, database_url: str, ops: Ops, attributes: str
) -> None:
    operation = ops.new()

    error = refused(
        login(AGENT),
        "INSERT INTO operation_events (operation_id, name, attributes) "
        "VALUES (%s, 'agent.completed', %s::jsonb)",
        (operation.id, attributes),
    )

    assert isinstance(error, psycopg.errors.CheckViolation)
    assert [n for n, _ in events_of(database_url, operation.id)] == ["operation.prepared"]


# --- approvals: a grant writes its event, at the database's clock, for at most 7 days --


def test_a_hand_typed_grant_is_evidence_and_cannot_outrank_a_later_denial(
    login: Login, database_url: str, ops: Ops
) -> None:
    operator = login(OPERATOR)
    waiting = ops.new(amount_cents=60_000)
    insert = (
        "INSERT INTO approvals (id, operation_id, intent_hash, approved_by, expires_at{extra}) "
        "VALUES (gen_random_uuid(), %s, %s, 'mallory@example.com', {expires}{value})"
    )
    for extra, expires, value, kind in (
        (
            ", created_at",
            "now() + interval '1 hour'",
            ", '2999-01-01'",
            psycopg.errors.InsufficientPrivilege,
        ),
        ("", "'infinity'", "", psycopg.errors.CheckViolation),
        ("", "now() + interval '30 days'", "", psycopg.errors.CheckViolation),
    ):
        error = refused(
            operator,
            insert.format(extra=extra, expires=expires, value=value),
            (waiting.id, waiting.input_fingerprint),
        )
        assert isinstance(error, kind), (extra, expires)

    with psycopg.connect(operator) as connection:
        connection.execute(
            insert.format(extra="", expires="now() + interval '1 hour'", value=""),
            (waiting.id, waiting.input_fingerprint),
        )
    granted = ops.run(outbox_store.check_approval(waiting.id))
    decide(ops, waiting.id, ApprovalDecision.DENIED, timedelta(minutes=15))

    assert granted.status is ApprovalStatus.VALID
    assert [(n, a.get("by")) for n, a in events_of(database_url, waiting.id)][1:] == [
        ("operation.approval_granted", "mallory@example.com"),
        ("operation.approval_denied", "lead@example.com"),
    ]
    assert ops.run(outbox_store.check_approval(waiting.id)).status is ApprovalStatus.DENIED


def test_a_grant_longer_than_the_policy_is_refused_before_the_database(ops: Ops) -> None:
    waiting = ops.new(amount_cents=60_000)
    with pytest.raises(ValueError, match="at most 7 days"):
        decide(ops, waiting.id, ApprovalDecision.GRANTED, timedelta(days=8))


# --- what the agent may read -----------------------------------------------------------


def test_the_agent_reads_neither_inputs_nor_who_approved(
    login: Login, database_url: str, registry: Registry, ops: Ops
) -> None:
    agent = login(AGENT)
    mine = record_as(agent, registry, refund(amount_cents=60_000, reason="for the agent only"))
    decide(ops, mine.id, ApprovalDecision.DENIED, timedelta(minutes=15))

    for statement in ("SELECT input FROM operations", "SELECT approved_by FROM approvals"):
        assert isinstance(refused(agent, statement), psycopg.errors.InsufficientPrivilege)
    # What it needs still works: recording again, and asking how an approval stands.
    again = record_as(agent, registry, refund())
    with psycopg.connect(agent) as connection:
        same = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "p", "amount_cents": 5},
            run_id="r",
            decision_key="k",
        )
        repeated = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "p", "amount_cents": 5},
            run_id="r",
            decision_key="k",
        )
        check = Store(connection).run(outbox_store.check_approval(mine.id))
    assert again.state is S.PREPARED
    assert (same.created, repeated.created) == (True, False)
    assert repeated.operation.input == {
        "payment_id": "p",
        "amount_cents": 5,
        "currency": "EUR",
        "reason": "",
    }
    assert check.status is ApprovalStatus.DENIED
    assert "lead@example.com" not in check.reason
    assert check.approval is not None
    assert check.approval.approved_by is None


# --- one short fingerprint, the keyed one ----------------------------------------------


def test_every_short_fingerprint_a_person_reads_is_the_keyed_one(
    login: Login,
    ops: Ops,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    operator = login(OPERATOR)
    waiting = ops.new(amount_cents=60_000)
    key = ops.run(outbox_store.fingerprint_key())
    keyed, raw = keyed_fingerprint(key, waiting.input_fingerprint), waiting.input_fingerprint[:12]

    shown = cli(monkeypatch, capsys, operator, "ops", "show", waiting.display_id)
    listed = cli(monkeypatch, capsys, operator, "ops", "list", "--json")
    pending = cli(monkeypatch, capsys, operator, "approvals", "pending")
    granted = cli(
        monkeypatch, capsys, operator, "approvals", "grant", waiting.display_id, "--by", "lead"
    )
    events = ops.events(waiting.id)

    for output in (shown, listed, pending, granted):
        assert keyed in output
        assert raw not in output
    assert all(raw not in json.dumps(event.attributes) for event in events)


# --- readers that survive a hostile row ------------------------------------------------


async def test_the_dispatcher_publishes_past_poison_headers_written_around_the_bounds(
    settings: Settings, database_url: str, ops: Ops
) -> None:
    poisoned, huge, clean = ops.new(), ops.new(), ops.new()
    for operation, headers in (
        (poisoned, DEEP),
        (huge, json.dumps({"traceparent": "0" * 300_000})),
    ):
        with_trigger_off(
            database_url,
            "outbox",
            "outbox_guard_update",
            "UPDATE outbox SET headers = %s::jsonb WHERE operation_id = %s",
            (headers, operation.id),
        )
    execute_admin(
        database_url,
        "UPDATE outbox SET headers = %s WHERE operation_id = %s",
        (Jsonb({"traceparent": TRACEPARENT}), clean.id),
    )

    async with running_dispatcher(settings) as dispatcher:
        await eventually(lambda: all_published(database_url, 3), within=20, what="all published")
        assert dispatcher.healthy()
    received = await read_all(settings.amqp_url.get_secret_value(), settings.queue, expect=3)

    traces = {
        r.message.correlation_id: (r.message.headers or {}).get("traceparent") for r in received
    }
    assert traces == {str(poisoned.id): None, str(huge.id): None, str(clean.id): TRACEPARENT}


async def test_an_unreadable_input_is_quarantined_and_its_burst_neighbours_run(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    database_url: str,
    ops: Ops,
) -> None:
    poisoned, neighbour = ops.new(), ops.new()
    poison_input(database_url, poisoned.id)

    async with running_consumer(settings, registry) as consumer, running_dispatcher(settings):
        await eventually(
            in_state(database_url, poisoned.id, S.ESCALATED), within=30, what="quarantined"
        )
        await eventually(
            in_state(database_url, neighbour.id, S.COMMITTED), within=30, what="neighbour ran"
        )
        assert consumer.healthy()

    escalation = [a for n, a in events_of(database_url, poisoned.id) if n == "operation.escalated"]
    assert escalation == [
        {"from": "prepared", "to": "escalated", "reason": "unreadable", "check": "too_deep"}
    ]
    assert unreadable_reason(ops.get(poisoned.id).input) == "too_deep"
    assert ledger.calls == [str(neighbour.id)]


async def test_the_reconciler_quarantines_an_unknown_outcome_whose_input_is_unreadable(
    settings: Settings, registry: Registry, ledger: Ledger, database_url: str, ops: Ops
) -> None:
    unknown = ops.at(S.OUTCOME_UNKNOWN)
    poison_input(database_url, unknown.id)

    async with running_consumer(settings, registry) as consumer:
        await eventually(
            in_state(database_url, unknown.id, S.ESCALATED), within=30, what="quarantined"
        )
        assert consumer.healthy()
        assert (
            counter_value(
                consumer, "outbox_consumer_unreadable_total", tool="send_refund", column="input"
            )
            == 1
        )

    escalation = [a for n, a in events_of(database_url, unknown.id) if n == "operation.escalated"]
    assert escalation == [
        {"from": "outcome_unknown", "to": "escalated", "reason": "unreadable", "check": "too_deep"}
    ]
    assert ledger.calls == []


def test_the_console_reads_past_a_poison_row(
    login: Login, settings: Settings, database_url: str, ops: Ops
) -> None:
    operator = login(OPERATOR)
    poisoned = ops.new(amount_cents=60_000)
    poison_input(database_url, poisoned.id, "reason")
    poison_event(database_url, poisoned.id)
    web = logged_in(client(console(console_settings(settings, operator))))

    page = web.get(f"/operations/{poisoned.display_id}")
    approvals = web.get("/approvals")

    assert page.status_code == 200
    assert "unreadable: too_deep" in page.text
    assert "the agent says:" in page.text
    assert approvals.status_code == 200
    assert poisoned.display_id in approvals.text


def test_an_input_larger_than_record_decision_accepts_is_never_executed(
    login: Login, database_url: str, registry: Registry
) -> None:
    """The database's own ceiling is wider than record_decision's; what only the SQL path
    could write is escalated as tampered, never executed."""
    big = {
        "payment_id": "pay_1",
        "amount_cents": 1,
        "currency": "EUR",
        "reason": "x" * MAX_INPUT_BYTES,
    }
    assert len(canonical_json(big)) > MAX_INPUT_BYTES
    with psycopg.connect(login(AGENT)) as connection:
        operation_id = connection.execute(
            RECORD_DECISION,
            (uuid.uuid4(), "r", "k", Jsonb(big), fingerprint_of(big), Jsonb({})),
        ).fetchone()
    assert operation_id is not None
    operation = Ops(database_url, registry).get(operation_id[0])

    intent = derive_intent(registry.get("send_refund"), operation)
    assert intent.disagreement == "input_too_large"


def test_every_operator_view_reads_past_a_poison_row(
    login: Login,
    database_url: str,
    ops: Ops,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    operator = login(OPERATOR)
    poisoned, waiting = ops.new(amount_cents=60_000), ops.new(amount_cents=60_000)
    poison_input(database_url, poisoned.id, "reason")
    poison_event(database_url, poisoned.id)
    with_trigger_off(
        database_url,
        "operation_events",
        "operation_events_by_role",
        "INSERT INTO operation_events (operation_id, name, attributes) "
        "VALUES (%s, 'agent.completed', '{\"operation.resolved by\": \"ceo@example.com\"}')",
        (waiting.id,),
    )

    shown = cli(monkeypatch, capsys, operator, "ops", "show", poisoned.display_id)
    other = cli(monkeypatch, capsys, operator, "ops", "show", waiting.display_id)
    pending = cli(monkeypatch, capsys, operator, "approvals", "pending")
    verified = cli(monkeypatch, capsys, operator, "ops", "verify", "--all")

    assert "(unreadable: too_deep" in shown
    assert "(attributes unreadable: too_deep" in shown
    assert 'the agent says: "operation.resolved by"=ceo@example.com' in other
    assert waiting.display_id in pending
    assert poisoned.display_id in pending
    assert "intact" in verified
    # And an operator can always end it.
    cancelled = cli(
        monkeypatch,
        capsys,
        operator,
        "ops",
        "cancel",
        poisoned.display_id,
        "--reason",
        "unreadable input",
        "--by",
        "lead",
    )
    assert "prepared -> rejected" in cancelled


# --- evidence that must agree with the row ---------------------------------------------


def test_verify_finds_a_state_no_event_supports_and_an_operation_with_no_birth(
    database_url: str, ops: Ops
) -> None:
    moved_silently = ops.at(S.IN_FLIGHT)
    execute_admin(
        database_url,
        "UPDATE operations SET state = 'committed', lease_owner = NULL, lease_expires_at = NULL "
        "WHERE id = %s",
        (moved_silently.id,),
    )
    tool_input = refund()
    unborn = uuid.uuid4()
    execute_admin(
        database_url,
        "INSERT INTO operations (id, run_id, tool_name, tool_version, side_effect, input, "
        "input_fingerprint) VALUES (%s, 'r', 'send_refund', 1, 'deduplicated_write', %s, %s)",
        (unborn, Jsonb(tool_input), fingerprint_of(tool_input)),
    )
    healthy = ops.at(S.COMMITTED)

    report = ops.run(outbox_store.verify_chain())

    broken = {(link.operation_id, link.reason) for link in report.broken}
    assert broken == {(moved_silently.id, "state_mismatch"), (unborn, "missing_birth")}
    assert ops.run(outbox_store.verify_chain(healthy.id)).intact


# --- provider values -------------------------------------------------------------------


def test_a_bulky_result_is_recorded_as_a_marker_and_a_long_reference_is_cut(
    login: Login, database_url: str, ops: Ops
) -> None:
    in_flight = ops.at(S.IN_FLIGHT)
    committed = ops.run(
        outbox_store.commit_many(
            [
                outbox_store.ConfirmedEffect(
                    operation=in_flight,
                    provider_reference="re_" + "x" * 1000,
                    result={"receipt": "y" * 100_000},
                    attributes={"attempt": 1},
                )
            ]
        )
    )[in_flight.id]
    other = ops.at(S.IN_FLIGHT)
    consumer = login(CONSUMER)
    with psycopg.connect(consumer) as connection:
        connection.execute(
            "UPDATE operations SET result = jsonb_build_object('deep', %s::jsonb) WHERE id = %s",
            (DEEP, other.id),
        )
    error = refused(
        consumer,
        "UPDATE operations SET provider_reference = %s WHERE id = %s",
        ("r" * (MAX_PROVIDER_REFERENCE + 1), other.id),
    )

    assert unreadable_reason(committed.result) == "too_large"
    assert committed.provider_reference is not None
    assert len(committed.provider_reference) == MAX_PROVIDER_REFERENCE
    assert unreadable_reason(ops.get(other.id).result) == "too_deep"
    assert isinstance(error, psycopg.errors.CheckViolation)


# --- the callbacks role: one write path, every value bounded (schema version 7) --------

RECORD_CALLBACK = "SELECT * FROM outbox_record_callback(%s, %s, %s, %s, %s, %s)"
DIGEST = "c" * 64
REFERENCE_CHECK = "callbacks_provider_reference_check"
DIGEST_CHECK = "callbacks_payload_digest_check"


def callbacks_rows(database_url: str) -> list[tuple[Any, ...]]:
    return execute_admin(database_url, "SELECT * FROM callbacks ORDER BY id")


def test_the_callbacks_role_chooses_no_id_time_or_outcome(
    login: Login, database_url: str, ops: Ops
) -> None:
    receiver = login(CALLBACKS)
    operation = ops.at(S.OUTCOME_UNKNOWN)
    [(before,)] = execute_admin(database_url, "SELECT clock_timestamp()")

    with psycopg.connect(receiver) as connection:
        connection.execute(
            RECORD_CALLBACK, ("payments", "evt_1", "committed", operation.id, "re_1", DIGEST)
        )
    [(after,)] = execute_admin(database_url, "SELECT clock_timestamp()")
    # Its only privilege is the function: no column of the inbox is its to name.
    error = refused(
        receiver,
        "INSERT INTO callbacks (id, provider, event_id, status, payload_digest, received_at, "
        "outcome, applied_at) OVERRIDING SYSTEM VALUE VALUES (1, 'payments', 'evt_2', "
        "'committed', repeat('0', 64), now() - interval '1 day', 'settled', now())",
    )

    assert isinstance(error, psycopg.errors.InsufficientPrivilege)
    [(received_at, outcome, applied_at)] = execute_admin(
        database_url, "SELECT received_at, outcome, applied_at FROM callbacks"
    )
    assert before <= received_at <= after
    assert (outcome, applied_at) == (None, None)
    # It moved nothing: the operation is still the reconciler's to settle.
    assert ops.get(operation.id).state is S.OUTCOME_UNKNOWN


@pytest.mark.parametrize(
    ("arguments", "constraint"),
    [
        (("Payments", "evt", "committed", None, None, DIGEST), "callbacks_provider_check"),
        (("pay/ments", "evt", "committed", None, None, DIGEST), "callbacks_provider_check"),
        (("payments", "evt\x1b[2J", "committed", None, None, DIGEST), "callbacks_event_id_check"),
        (("payments", "evt 1", "committed", None, None, DIGEST), "callbacks_event_id_check"),
        (("payments", "e" * 256, "committed", None, None, DIGEST), "callbacks_event_id_check"),
        (("payments", "", "committed", None, None, DIGEST), "callbacks_event_id_check"),
        (("payments", "evt", "settled", None, None, DIGEST), "callbacks_status_check"),
        (
            ("payments", "evt", "committed", None, "r" * 501, DIGEST),
            "callbacks_provider_reference_check",
        ),
        (
            ("payments", "evt", "committed", None, "re\r\n1", DIGEST),
            "callbacks_provider_reference_check",
        ),
        (("payments", "evt", "committed", None, "", DIGEST), "callbacks_provider_reference_check"),
        (
            ("payments", "evt", "committed", None, None, "<script>"),
            "callbacks_payload_digest_check",
        ),
    ],
)
def test_the_callbacks_role_is_refused_every_value_outside_the_bounds(
    login: Login, database_url: str, arguments: tuple[Any, ...], constraint: str
) -> None:
    receiver = login(CALLBACKS)

    error = refused(receiver, RECORD_CALLBACK, arguments)

    assert isinstance(error, psycopg.errors.CheckViolation)
    assert error.diag.constraint_name == constraint
    assert callbacks_rows(database_url) == []


def test_a_shadowed_operations_table_does_not_fool_the_callback_path(
    login: Login, database_url: str, ops: Ops
) -> None:
    # TEMPORARY granted back, as a deployment may: the pinned search_path holds alone.
    receiver = login(CALLBACKS, temporary=True)
    operation = ops.at(S.OUTCOME_UNKNOWN)
    ghost = uuid.uuid4()

    with psycopg.connect(receiver) as connection:
        connection.execute(
            "CREATE TEMP TABLE operations (id uuid, provider_reference text, "
            "created_at timestamptz)"
        )
        connection.execute("INSERT INTO operations VALUES (%s, 're_ghost', now())", (ghost,))
        ghostly = connection.execute(
            RECORD_CALLBACK, ("payments", "evt_1", "committed", ghost, None, DIGEST)
        ).fetchone()
        real = connection.execute(
            RECORD_CALLBACK, ("payments", "evt_2", "committed", operation.id, None, DIGEST)
        ).fetchone()

    assert ghostly is not None
    assert real is not None
    assert (ghostly[1], ghostly[2]) == ("unmatched", None)
    assert (real[1], real[2]) == ("recorded", operation.id)


def test_the_consumer_sets_a_callbacks_outcome_once_and_nothing_else(
    login: Login, database_url: str, ops: Ops
) -> None:
    consumer = login(CONSUMER)
    operation = ops.at(S.COMMITTED)
    execute_admin(
        database_url,
        RECORD_CALLBACK,
        ("payments", "evt_1", "committed", operation.id, "re_found", DIGEST),
    )

    with psycopg.connect(consumer) as connection:
        connection.execute("UPDATE callbacks SET outcome = 'confirmed'")
    applied = callbacks_rows(database_url)
    second = refused(consumer, "UPDATE callbacks SET outcome = 'settled'")
    cleared = refused(consumer, "UPDATE callbacks SET outcome = NULL")
    rewritten = refused(consumer, "UPDATE callbacks SET provider_reference = 're_other'")
    backdated = refused(consumer, "UPDATE callbacks SET applied_at = now() - interval '1 day'")
    # The owner too: what a provider reported is frozen for everyone.
    frozen = refused(database_url, "UPDATE callbacks SET status = 'rejected'")

    assert isinstance(second, psycopg.errors.CheckViolation)
    assert isinstance(cleared, psycopg.errors.CheckViolation)
    assert isinstance(rewritten, psycopg.errors.InsufficientPrivilege)
    assert isinstance(backdated, psycopg.errors.InsufficientPrivilege)
    assert isinstance(frozen, psycopg.errors.InsufficientPrivilege)
    assert "callbacks_evidence_frozen" in str(frozen.diag.constraint_name)
    assert callbacks_rows(database_url) == applied
    assert applied[0][-2:][0] == "confirmed"


@pytest.mark.parametrize("group", [AGENT, CONSUMER])
def test_no_component_forges_a_callback_received_event(
    login: Login, database_url: str, ops: Ops, group: str
) -> None:
    attacker = login(group)
    operation = ops.at(S.OUTCOME_UNKNOWN)

    error = refused(
        attacker,
        "INSERT INTO operation_events (operation_id, name, attributes) VALUES "
        "(%s, 'operation.callback_received', '{\"status\": \"committed\"}')",
        (operation.id,),
    )

    assert isinstance(error, psycopg.errors.InsufficientPrivilege)
    assert "operation.callback_received" not in ops.event_names(operation.id)
