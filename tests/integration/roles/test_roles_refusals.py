"""What every role is refused: writes its component never makes, forged operations,
events and approvals, rewritten intents.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import psycopg
import psycopg.errors
import pytest
from psycopg.types.json import Jsonb
from pydantic import SecretStr

from consumer.worker import Consumer
from outbox import DecisionBlocked, Operation, Registry, Settings, record_decision
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.broker import OperationMessage
from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.errors import DatabaseError
from outbox.models import ApprovalDecision, CallbackOutcome, RecordedDecision
from outbox.store.runner import Store

from support.db_helpers import execute_admin
from support.dispatch_helpers import counter_value
from support.logins import Login
from support.logs import logged
from support.roles_cases import (
    AGENT,
    CALLBACKS,
    CONSUMER,
    DISPATCHER,
    OPERATOR,
    S,
    advance,
    new_operation,
    run,
    snapshot,
)
from support.sample_tools import Ledger

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
def test_the_agent_appends_no_event_at_all(
    login: Login, roles_database: str, seeded: dict[str, Operation], name: str
) -> None:
    agent = login(AGENT)
    before = snapshot(roles_database)

    with (
        psycopg.connect(agent) as connection,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"),
    ):
        connection.execute(
            "INSERT INTO operation_events (operation_id, name, attributes) VALUES (%s, %s, %s)",
            (seeded["escalated"].id, name, Jsonb({"by": "mallory", "decision": "rejected"})),
        )

    assert snapshot(roles_database) == before


def recorded_by(login_url: str, registry: Registry) -> Operation:
    """A refund decided as ``login_url``'s user, in its own transaction."""
    with psycopg.connect(login_url) as connection:
        return record_decision(
            connection, registry, "send_refund", {"payment_id": "p", "amount_cents": 1}, run_id="r"
        ).operation


def test_a_decision_behind_another_sessions_lock_says_so_and_its_retry_records_it_once(
    login: Login, roles_database: str, registry: Registry
) -> None:
    # Before version 11 the agent's write waited as long as the lock was held (a 60 s
    # LOCK TABLE held its tool call 60 s); the session's own 20 s bound here would have
    # ended it as an unexplained cancel instead.
    agent = login(AGENT)

    def decide(connection: psycopg.Connection[Any]) -> RecordedDecision:
        return record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "p_blocked", "amount_cents": 1},
            run_id="r",
            decision_key="k_blocked",
        )

    with psycopg.connect(roles_database) as analyst:
        analyst.execute("LOCK TABLE operations IN SHARE ROW EXCLUSIVE MODE")
        with (
            psycopg.connect(agent, options="-c statement_timeout=20000") as connection,
            pytest.raises(DecisionBlocked, match="retry it with the same decision key"),
        ):
            decide(connection)
    assert execute_admin(
        roles_database, "SELECT count(*) FROM operations WHERE decision_key = 'k_blocked'"
    ) == [(0,)]

    with psycopg.connect(agent) as connection:
        first = decide(connection)
    with psycopg.connect(agent) as connection:
        again = decide(connection)
    assert (first.created, again.created) == (True, False)
    assert again.operation.id == first.operation.id


def test_the_agent_reports_on_its_own_operation_and_the_reconciler_chains_it(
    login: Login, roles_database: str, registry: Registry
) -> None:
    agent = login(AGENT)
    own = recorded_by(agent, registry)
    with psycopg.connect(agent) as connection:
        Store(connection).run(
            outbox_store.report_agent_completed(own.id, {"agent.outcome": "refund_confirmed"})
        )
    # Not in the chain yet: it waits for a consumer, and holds no head meanwhile.
    names = [e.name for e in run(roles_database, outbox_store.events(own.id))]
    assert names == ["operation.prepared"]

    assert run(login(CONSUMER), outbox_store.chain_agent_reports(100)) == 1

    events = run(roles_database, outbox_store.events(own.id))
    assert [e.name for e in events] == ["operation.prepared", "agent.completed"]
    assert events[-1].attributes == {"agent.outcome": "refund_confirmed"}
    report = run(roles_database, outbox_store.verify_chain(own.id))
    assert report.intact
    assert report.events_checked == 2
    assert run(login(CONSUMER), outbox_store.chain_agent_reports(100)) == 0


def test_the_agent_reports_only_on_what_its_own_login_recorded(
    login: Login, roles_database: str, seeded: dict[str, Operation]
) -> None:
    # Recorded by the tables' owner, not by this login.
    agent = login(AGENT)

    with (
        psycopg.connect(agent) as connection,
        pytest.raises(DatabaseError, match="agent_reports_own_operations"),
    ):
        Store(connection).run(
            outbox_store.report_agent_completed(seeded["waiting"].id, {"agent.outcome": "x"})
        )
    with (
        psycopg.connect(agent) as connection,
        pytest.raises(DatabaseError, match="agent_reports_operation"),
    ):
        Store(connection).run(
            outbox_store.report_agent_completed(uuid.uuid4(), {"agent.outcome": "x"})
        )

    assert execute_admin(roles_database, "SELECT count(*) FROM agent_reports") == [(0,)]


def test_an_operation_takes_sixteen_agent_reports_at_most(
    login: Login, roles_database: str, registry: Registry
) -> None:
    agent = login(AGENT)
    own = recorded_by(agent, registry)
    for number in range(16):
        with psycopg.connect(agent) as connection:
            Store(connection).run(outbox_store.report_agent_completed(own.id, {"agent.n": number}))
        if number == 7:  # some chained, some waiting: both count
            run(login(CONSUMER), outbox_store.chain_agent_reports(100))

    with (
        psycopg.connect(agent) as connection,
        pytest.raises(DatabaseError, match="agent_reports_bounded"),
    ):
        Store(connection).run(outbox_store.report_agent_completed(own.id, {"agent.n": 16}))

    run(login(CONSUMER), outbox_store.chain_agent_reports(100))
    names = [e.name for e in run(roles_database, outbox_store.events(own.id))]
    assert names.count("agent.completed") == 16


def test_an_agent_transaction_left_open_holds_no_operation_back(
    login: Login, roles_database: str, registry: Registry
) -> None:
    # Before version 10 an agent's INSERT of agent.completed, left open, locked the
    # operation's chain head: every transition of it waited, and a consumer's lease ran
    # out. Now the report locks nothing a daemon takes.
    agent = login(AGENT)
    own = recorded_by(agent, registry)
    with psycopg.connect(agent) as held:
        Store(held).run(outbox_store.report_agent_completed(own.id, {"agent.outcome": "x"}))
        # The agent's transaction stays open while the consumer claims and moves it,
        # with a lock_timeout that turns any wait into an error.
        with psycopg.connect(login(CONSUMER)) as consumer:
            consumer.execute("SET lock_timeout = '2s'")
            claimed = Store(consumer).run(
                outbox_store.claim(own.id, owner="worker-1", lease=timedelta(seconds=30))
            )
            assert claimed is not None
        assert run(login(CONSUMER), outbox_store.chain_agent_reports(100)) == 0  # not committed
        held.rollback()

    assert execute_admin(
        roles_database, "SELECT state FROM operations WHERE id = %s", (own.id,)
    ) == [("in_flight",)]


def test_a_callbacks_transaction_left_open_holds_no_operation_back(
    login: Login, roles_database: str, registry: Registry
) -> None:
    # Before version 11 outbox_record_callback took a share lock on the operation's row
    # and appended operation.callback_received in the caller's transaction: a callbacks
    # login that left it open stopped the consumer recording the attempt's outcome
    # (its lease ran out) and every append to that operation's chain. Now the
    # recording locks nothing a daemon's write waits for, and the event is chained when
    # the consumer applies the callback.
    operation = new_operation(roles_database, registry)
    with psycopg.connect(login(CONSUMER)) as consumer:
        claimed = Store(consumer).run(
            outbox_store.claim(operation.id, owner="worker-1", lease=timedelta(seconds=30))
        )
    assert claimed is not None
    report = CallbackReport(
        event_id="evt_held", status=CallbackStatus.COMMITTED, operation_id=operation.id
    )
    with psycopg.connect(login(CALLBACKS)) as held:
        receipt = Store(held).run(outbox_store.record_callback("payments", report, "0" * 64))
        assert receipt.result == "recorded"
        # The callbacks transaction stays open while the consumer records the outcome
        # and locks the row as the reconciler does, with a lock_timeout that turns any
        # wait into an error.
        with psycopg.connect(login(CONSUMER)) as consumer:
            consumer.execute("SET lock_timeout = '2s'")
            moved = Store(consumer).run(
                outbox_store.transition(
                    operation.id,
                    source=S.IN_FLIGHT,
                    target=S.COMMITTED,
                    lease_token=claimed.lease_token,
                    provider_reference="re_held",
                )
            )
            assert moved.state is S.COMMITTED
            locked = Store(consumer).run(outbox_store.lock_operation(operation.id))
            assert locked is not None
        held.commit()

    names = [e.name for e in run(roles_database, outbox_store.events(operation.id))]
    assert names[-1] == "operation.committed"
    assert "operation.callback_received" not in names  # chained when applied
    with psycopg.connect(login(CONSUMER)) as consumer:
        store = Store(consumer)
        [pending] = store.run(
            outbox_store.claim_callback_batch(
                [f"{operation.tool_name}.v{operation.tool_version}"], 10
            )
        )
        store.run(outbox_store.mark_callback(pending, CallbackOutcome.CONFIRMED))
    events = run(roles_database, outbox_store.events(operation.id))
    assert events[-1].name == "operation.callback_received"
    assert events[-1].attributes["callback"] == receipt.callback_id
    assert events[-1].attributes["status"] == "committed"
    assert run(roles_database, outbox_store.verify_chain(operation.id)).intact


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


def test_one_forbidden_event_refuses_the_whole_statement_that_appends_it(
    login: Login, roles_database: str, seeded: dict[str, Operation]
) -> None:
    """The names are checked once per statement, over every row it appended: a row the
    consumer may append does not carry one it may not past the check, in either order,
    and nothing of the statement stays (its events, their chain heads)."""
    consumer = login(CONSUMER)
    before = snapshot(roles_database)

    for names in (
        ["operation.lookup_deferred", "operation.resolved"],
        ["operation.resolved", "operation.lookup_deferred"],
    ):
        with (
            psycopg.connect(consumer) as connection,
            pytest.raises(
                psycopg.errors.InsufficientPrivilege, match=r"may not append operation\.resolved"
            ),
        ):
            connection.execute(
                "INSERT INTO operation_events (operation_id, name)"
                " SELECT %s, name FROM unnest(%s::text[]) AS n (name)",
                (seeded["escalated"].id, names),
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


async def test_a_consumer_that_may_not_chain_reports_still_reconciles(
    login: Login,
    roles_database: str,
    registry: Registry,
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent, consumer_user = login(AGENT), login(CONSUMER)
    own = recorded_by(agent, registry)
    with psycopg.connect(agent) as connection:
        Store(connection).run(outbox_store.report_agent_completed(own.id, {"agent.outcome": "x"}))
    unknown = advance(roles_database, new_operation(roles_database, registry), S.IN_FLIGHT)
    unknown = advance(roles_database, unknown, S.OUTCOME_UNKNOWN)
    # As a database migrated to version 10 without --roles looks to its consumer.
    execute_admin(
        roles_database,
        "REVOKE EXECUTE ON FUNCTION outbox_chain_agent_reports(integer) FROM outbox_consumer",
    )
    consumer = Consumer(
        settings.model_copy(update={"database_url": SecretStr(consumer_user)}), registry
    )
    try:
        await consumer.reconciler.reconcile_once()
    finally:
        await consumer.close()

    assert logged(caplog, "consumer.agent_reports_refused")
    assert execute_admin(roles_database, "SELECT count(*) FROM agent_reports") == [(1,)]
    # The pass went on to the unknown outcome: looked up and settled, not left behind.
    after = run(roles_database, outbox_store.get_operation(unknown.id))
    assert after.state is not S.OUTCOME_UNKNOWN or after.reconcile_attempts > 0
