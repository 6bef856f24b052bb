"""Bad input at every door: each is refused or dead-lettered with a reason, causes no
effect, and leaves the schema as it was."""

from __future__ import annotations

import json
from typing import Any

import pytest

from outbox import (
    InputRejected,
    OperationState,
    Registry,
    Settings,
    record_decision,
)

from support.consume_helpers import events, operation, publish_raw, running_consumer
from support.db_helpers import execute_admin
from support.dispatch_helpers import counter_value, running_dispatcher
from support.sample_tools import Ledger, refund_contract
from support.waiting import eventually

S = OperationState
SCHEMA_SHAPE = """
SELECT table_name, column_name, data_type
FROM information_schema.columns
WHERE table_schema = 'public'
ORDER BY table_name, column_name
"""
ODD_IDS = [
    "'; DROP TABLE operations; --",
    'run"with\\quotes',
    "rün-\u0131d-💥-\u202e-mixed",  # dotless i, an emoji, a right-to-left override
    "%(id)s %s {0} $1",
]


def envelope(op: Any, **changes: Any) -> bytes:
    body = {
        "v": 1,
        "operation_id": str(op.id),
        "outbox_id": 1,
        "tool": op.tool_name,
        "tool_version": op.tool_version,
        "input_fingerprint": op.input_fingerprint,
    }
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize("odd", ODD_IDS)
def test_odd_run_ids_and_decision_keys_are_stored_verbatim_not_executed(
    engine: Any, registry: Registry, database_url: str, odd: str
) -> None:
    shape = execute_admin(database_url, SCHEMA_SHAPE)
    with engine.begin() as connection:
        recorded = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 5, "reason": odd},
            run_id=odd,
            decision_key=odd,
        )
    with engine.begin() as connection:
        again = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 5, "reason": odd},
            run_id=odd,
            decision_key=odd,
        )

    assert again.operation.id == recorded.operation.id
    assert not again.created
    stored = execute_admin(
        database_url,
        "SELECT run_id, decision_key, input->>'reason' FROM operations WHERE id = %s",
        (recorded.operation.id,),
    )
    assert stored == [(odd, odd, odd)]
    assert execute_admin(database_url, SCHEMA_SHAPE) == shape


@pytest.mark.parametrize(
    ("tool", "problem"),
    [("send_refund'; --", "not registered"), ("", "not registered"), ("💥", "not registered")],
)
def test_decisions_for_odd_tool_names_are_refused(
    engine: Any, registry: Registry, database_url: str, tool: str, problem: str
) -> None:
    from outbox import ToolNotRegistered

    with engine.begin() as connection, pytest.raises(ToolNotRegistered, match=problem):
        record_decision(connection, registry, tool, {}, run_id="r")
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == [(0,)]


def test_input_with_a_nul_character_is_refused_before_the_database(
    engine: Any, registry: Registry, database_url: str
) -> None:
    with engine.begin() as connection, pytest.raises(InputRejected, match="NUL"):
        record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 5, "reason": "a\x00b"},
            run_id="r",
        )
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == [(0,)]


async def test_forged_and_replayed_messages_for_settled_operations_cause_no_effect(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    amqp_server_url: str,
) -> None:
    fast = settings.model_copy(update={"reconcile_interval": 0.05})
    with engine.begin() as connection:
        done = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 5},
            run_id="r",
        ).operation
    ledger.faults.append("reject")
    with engine.begin() as connection:
        refused = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_2", "amount_cents": 5},
            run_id="r",
        ).operation
    async with running_dispatcher(fast), running_consumer(fast, registry) as consumer:

        async def settled() -> bool:
            states = {
                operation(database_url, done.id).state,
                operation(database_url, refused.id).state,
            }
            return states == {S.COMMITTED, S.REJECTED}

        await eventually(settled, within=20, what="both operations settled")
        settled_as = {op.id: operation(database_url, op.id).state for op in (done, refused)}
        calls_before = list(ledger.calls)
        # The old messages again, as a replay would send them, and a forgery that claims
        # another outbox id: the database says these operations are settled.
        for op in (done, refused):
            await publish_raw(amqp_server_url, fast.exchange, envelope(op))
            await publish_raw(amqp_server_url, fast.exchange, envelope(op, outbox_id=999_999))

        async def handled() -> bool:
            return (
                counter_value(consumer, "outbox_consumer_deliveries_total", result="duplicate") == 4
            )

        await eventually(handled, within=20, what="four duplicates counted")

    assert ledger.calls == calls_before
    assert {op.id: operation(database_url, op.id).state for op in (done, refused)} == settled_as
    # Each suppressed delivery is on the record, with the state that stopped it.
    suppressed = {
        op.id: [
            event.attributes
            for event in events(database_url, op.id)
            if event.name == "operation.delivery_suppressed"
        ]
        for op in (done, refused)
    }
    # Which of the two the ledger refused depends on delivery order; each got 2 replays.
    assert suppressed == {op.id: [{"state": str(settled_as[op.id])}] * 2 for op in (done, refused)}


async def test_a_version_this_consumer_does_not_have_is_dead_lettered(
    settings: Settings, ledger: Ledger, engine: Any, amqp_server_url: str
) -> None:
    both = Registry()
    both.register(refund_contract(ledger, version=1))
    both.register(refund_contract(ledger, version=2))
    only_v1 = Registry()
    only_v1.register(refund_contract(ledger, version=1))
    with engine.begin() as connection:
        v2 = record_decision(
            connection,
            both,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 5},
            run_id="r",
            tool_version=2,
        ).operation
    async with running_consumer(settings, only_v1) as consumer:
        await publish_raw(amqp_server_url, settings.exchange, envelope(v2), "send_refund.v2")

        async def dead_lettered() -> bool:
            return (
                counter_value(
                    consumer, "outbox_consumer_dead_lettered_total", reason="unknown_tool"
                )
                == 1
            )

        await eventually(dead_lettered, within=20, what="the v2 message dead-lettered")

    assert ledger.calls == []


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"tool": "send_refund'; drop table operations; --"}, "malformed"),
        ({"tool_version": 0}, "malformed"),
        ({"v": 2}, "malformed"),
        ({"extra": "field"}, "malformed"),
        ({"input_fingerprint": "ZZ" * 32}, "malformed"),
        ({"tool_version": 7}, "envelope_mismatch"),
    ],
)
async def test_envelopes_that_bend_the_rules_are_dead_lettered(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    amqp_server_url: str,
    changes: dict[str, Any],
    reason: str,
) -> None:
    shape = execute_admin(database_url, SCHEMA_SHAPE)
    with engine.begin() as connection:
        op = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": 5},
            run_id="r",
        ).operation
    async with running_consumer(settings, registry) as consumer:
        await publish_raw(amqp_server_url, settings.exchange, envelope(op, **changes))

        async def dead_lettered() -> bool:
            return (
                counter_value(consumer, "outbox_consumer_dead_lettered_total", reason=reason) == 1
            )

        await eventually(dead_lettered, within=20, what=f"a {reason} envelope dead-lettered")

    assert ledger.calls == []
    assert operation(database_url, op.id).state is S.PREPARED
    assert execute_admin(database_url, SCHEMA_SHAPE) == shape
