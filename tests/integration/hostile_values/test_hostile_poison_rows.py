"""Poison rows written around the bounds: every reader and daemon goes past them."""

from __future__ import annotations

import json
import uuid
from typing import Any
from uuid import UUID

import psycopg
import psycopg.errors
import pytest
from psycopg.types.json import Jsonb

from outbox import Registry, Settings
from outbox import store as outbox_store
from outbox.bounds import MAX_INPUT_BYTES, MAX_PROVIDER_REFERENCE, unreadable_reason
from outbox.cli import run_command
from outbox.fingerprint import canonical_json
from outbox.fingerprint_key import keyed_fingerprint
from outbox.intent import derive_intent

from support.broker_helpers import read_all
from support.console_helpers import client, console, console_settings, logged_in
from support.consume_helpers import in_state, running_consumer
from support.db_helpers import execute_admin
from support.dispatch_helpers import all_published, counter_value, running_dispatcher
from support.hostile_cases import (
    AGENT,
    CONSUMER,
    DEEP,
    OPERATOR,
    RECORD_DECISION,
    TRACEPARENT,
    S,
    events_of,
    fingerprint_of,
    refund,
    refused,
)
from support.logins import Login
from support.ops_helpers import Ops
from support.sample_tools import Ledger
from support.waiting import eventually


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


def cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], url: str, *argv: str
) -> str:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", url)
    code = run_command(list(argv))
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err
    return captured.out


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


def test_a_reference_postgres_cannot_hold_is_recorded_cleaned(ops: Ops) -> None:
    """A provider's reference with a NUL or a lone surrogate in it: the effect happened,
    so its record must land (cleaned), or every retry of the record would fail too."""
    in_flight = ops.at(S.IN_FLIGHT)
    committed = ops.run(
        outbox_store.commit_many(
            [
                outbox_store.ConfirmedEffect(
                    operation=in_flight,
                    provider_reference="re_\udc80\x001",
                    result={"receipt": "ok"},
                    attributes={"attempt": 1},
                )
            ]
        )
    )[in_flight.id]

    assert committed.state is S.COMMITTED
    assert committed.provider_reference == "re_?1"
    stored = ops.run(outbox_store.get_operation(in_flight.id))
    assert stored.provider_reference == "re_?1"
    assert ops.events(in_flight.id)[-1].attributes["provider_reference"] == "re_?1"


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
