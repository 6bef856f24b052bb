"""The consumer and reconciler in process, with a tool whose provider injects faults."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy.exc

from consumer.claims import Claimed, Skip
from consumer.policy import LEASE_LOST_BEFORE_CALL, AttemptOutcome
from consumer.reconciler import Reconciler
from consumer.worker import Consumer
from dispatcher.daemon import Dispatcher
from outbox import (
    OperationState,
    Registry,
    Settings,
    SideEffect,
    ToolContract,
    grant_approval,
    record_decision,
    store,
)
from outbox.broker import OperationMessage
from outbox.store import Store

from support.broker_helpers import read_raw
from support.consume_helpers import (
    event_names,
    events,
    in_state,
    operation,
    publish_raw,
    running_consumer,
)
from support.db_helpers import execute_admin
from support.dispatch_helpers import counter_value, running_dispatcher
from support.logs import logged, records_of
from support.sample_tools import Ledger, RefundInput
from support.waiting import eventually

S = OperationState
REFUND = {"payment_id": "pay_1", "amount_cents": 1250}


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.model_copy(update={"reconcile_interval": 0.05, "lease_margin": 0.5})


def decide(engine: Any, registry: Registry, tool: str = "send_refund", **fields: Any) -> Any:
    with engine.begin() as connection:
        return record_decision(
            connection,
            registry,
            tool,
            {**REFUND, **fields} if tool == "send_refund" else fields,
            run_id="run",
        ).operation


async def settle(
    fast: Settings, registry: Registry, database_url: str, operation_id: Any, *states: S
) -> Any:
    async with running_dispatcher(fast), running_consumer(fast, registry) as consumer:
        await eventually(
            in_state(database_url, operation_id, *states), within=30, what=f"state in {states}"
        )
        return consumer


async def test_a_decision_becomes_one_confirmed_effect(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    op = decide(engine, registry)

    consumer = await settle(fast, registry, database_url, op.id, S.COMMITTED)

    final = operation(database_url, op.id)
    assert final.provider_reference == f"re_{str(op.id)[:8]}"
    assert ledger.calls == [str(op.id)]
    assert event_names(database_url, op.id) == [
        "operation.prepared",
        "operation.attempted",
        "operation.committed",
    ]
    assert counter_value(consumer, "outbox_consumer_deliveries_total", result="processed") == 1


async def test_a_lost_response_is_reconciled_not_retried(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    ledger.faults.append("drop_response")
    op = decide(engine, registry)

    await settle(fast, registry, database_url, op.id, S.COMMITTED)

    assert ledger.calls == [str(op.id)]  # one POST: no blind retry
    assert len(ledger.refunds) == 1
    assert event_names(database_url, op.id) == [
        "operation.prepared",
        "operation.attempted",
        "operation.outcome_unknown",
        "operation.reconciled",
    ]
    assert operation(database_url, op.id).provider_reference == f"re_{str(op.id)[:8]}"


async def test_a_deadline_cuts_a_hanging_call_and_reconciliation_settles_it(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    ledger.faults.append("hang")
    op = decide(engine, registry)

    await settle(fast, registry, database_url, op.id, S.COMMITTED)

    assert ledger.calls == [str(op.id)]
    assert operation(database_url, op.id).last_error_class == "deadline_exceeded"


async def test_a_failure_before_send_is_retried_once_more(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    ledger.faults.append("not_sent_here")
    op = decide(engine, registry)

    await settle(fast, registry, database_url, op.id, S.COMMITTED)

    assert ledger.calls == [str(op.id)] * 2
    assert len(ledger.refunds) == 1
    final = operation(database_url, op.id)
    assert final.attempts == 2
    assert "operation.retry_scheduled" in event_names(database_url, op.id)


async def test_a_refused_connection_waits_for_the_provider_and_spends_no_attempt(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    ledger.faults.extend(["not_sent", "not_sent"])
    op = decide(engine, registry)

    await settle(fast, registry, database_url, op.id, S.COMMITTED)

    assert ledger.calls == [str(op.id)] * 3
    assert len(ledger.refunds) == 1
    final = operation(database_url, op.id)
    assert (final.attempts, final.waiting_since) == (1, None)
    waits = [
        e.attributes for e in events(database_url, op.id) if e.name == "operation.retry_scheduled"
    ]
    assert [(w["policy"], w["unavailable"], w["reason"]) for w in waits] == [
        ("wait_for_provider", "unreachable", "connect_failed")
    ] * 2


async def test_a_definitive_rejection_ends_it_without_retry(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    ledger.faults.append("reject")
    op = decide(engine, registry)

    await settle(fast, registry, database_url, op.id, S.REJECTED)

    assert ledger.calls == [str(op.id)]
    assert ledger.refunds == {}
    assert operation(database_url, op.id).last_error_class == "amount_exceeds_payment"


async def test_unavailable_lookups_escalate_after_the_budget_without_a_second_call(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    ledger.faults.append("drop_response")
    ledger.lookups_unavailable = True
    op = decide(engine, registry)

    consumer = await settle(fast, registry, database_url, op.id, S.ESCALATED)

    assert ledger.calls == [str(op.id)]
    final = operation(database_url, op.id)
    assert final.reconcile_attempts == 3
    names = event_names(database_url, op.id)
    assert names.count("operation.reconcile_deferred") == 2
    assert names[-1] == "operation.escalated"
    assert (
        counter_value(
            consumer,
            "outbox_escalations_total",
            tool="send_refund",
            reason="reconcile_budget_exhausted",
        )
        == 1
    )


async def test_a_non_repeatable_write_without_lookup_escalates_at_once(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    ledger.faults.append("drop_response")
    op = decide(engine, registry, tool="open_ticket", title="printer on fire")

    await settle(fast, registry, database_url, op.id, S.ESCALATED)

    assert ledger.tickets == [str(op.id)]
    assert event_names(database_url, op.id)[-2:] == [
        "operation.outcome_unknown",
        "operation.escalated",
    ]


async def test_the_same_message_twice_executes_once(
    fast: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    amqp_server_url: str,
) -> None:
    op = decide(engine, registry)
    body = json.dumps(
        {
            "v": 1,
            "operation_id": str(op.id),
            "outbox_id": 1,
            "tool": "send_refund",
            "tool_version": 1,
            "input_fingerprint": op.input_fingerprint,
        }
    ).encode()
    async with running_consumer(fast, registry) as consumer:
        await publish_raw(amqp_server_url, fast.exchange, body)
        await publish_raw(amqp_server_url, fast.exchange, body)

        async def both_handled() -> bool:
            handled = sum(
                counter_value(consumer, "outbox_consumer_deliveries_total", result=result)
                for result in ("processed", "duplicate")
            )
            return handled == 2

        await eventually(both_handled, within=20, what="both deliveries handled")
        assert counter_value(consumer, "outbox_consumer_deliveries_total", result="duplicate") == 1

    assert ledger.calls == [str(op.id)]
    assert operation(database_url, op.id).state is S.COMMITTED
    assert event_names(database_url, op.id).count("operation.delivery_suppressed") == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\x00not json", "malformed"),
        (b'{"v": 1, "operation_id": "x"}', "malformed"),
        (b"x" * 5000, "oversized"),
    ],
)
async def test_poison_messages_are_dead_lettered_without_effect(
    fast: Settings,
    registry: Registry,
    ledger: Ledger,
    amqp_server_url: str,
    body: bytes,
    reason: str,
) -> None:
    async with running_consumer(fast, registry) as consumer:
        await publish_raw(amqp_server_url, fast.exchange, body)

        async def dead_lettered() -> bool:
            return (
                counter_value(consumer, "outbox_consumer_dead_lettered_total", reason=reason) == 1
            )

        await eventually(dead_lettered, within=20, what=f"a {reason} message dead-lettered")

    dead = await read_raw(amqp_server_url, fast.dead_letter_queue, expect=1)
    assert [m.body for m in dead] == [body]
    assert ledger.calls == []


@pytest.mark.parametrize("lie", ["unknown_operation", "envelope_mismatch", "unknown_tool"])
async def test_messages_that_do_not_match_the_database_cause_no_effect(
    fast: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    amqp_server_url: str,
    lie: str,
) -> None:
    op = decide(engine, registry)
    envelope: dict[str, Any] = {
        "v": 1,
        "operation_id": str(op.id),
        "outbox_id": 1,
        "tool": "send_refund",
        "tool_version": 1,
        "input_fingerprint": op.input_fingerprint,
    }
    if lie == "unknown_operation":
        envelope["operation_id"] = "00000000-0000-4000-8000-000000000000"
    elif lie == "envelope_mismatch":
        envelope["input_fingerprint"] = "0" * 64
    limited = Registry()  # a consumer that lacks the tool
    for contract in registry:
        if contract.name != "send_refund":
            limited.register(contract)
    chosen = limited if lie == "unknown_tool" else registry
    async with running_consumer(fast, chosen) as consumer:
        await publish_raw(amqp_server_url, fast.exchange, json.dumps(envelope).encode())

        async def dead_lettered() -> bool:
            return counter_value(consumer, "outbox_consumer_dead_lettered_total", reason=lie) == 1

        await eventually(dead_lettered, within=20, what=f"a {lie} message dead-lettered")

    assert ledger.calls == []


async def test_approval_gates_the_effect_and_binds_to_the_intent(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    op = decide(engine, registry, amount_cents=75_000)
    assert op.requires_approval
    async with running_dispatcher(fast), running_consumer(fast, registry):

        async def waiting() -> bool:
            names = await asyncio.to_thread(event_names, database_url, op.id)
            return "operation.approval_required" in names

        await eventually(waiting, within=20, what="the operation to wait for approval")
        assert ledger.calls == []

        other = decide(engine, registry, amount_cents=80_000)
        with engine.begin() as connection:  # approved a different amount: refused
            grant_approval(
                connection,
                op.id,
                approved_by="a@example.com",
                ttl=timedelta(minutes=5),
                intent_hash=other.input_fingerprint,
            )

        async def refused_twice() -> bool:
            names = await asyncio.to_thread(event_names, database_url, op.id)
            return names.count("operation.approval_required") == 2

        await eventually(refused_twice, within=20, what="the changed-intent grant refused")
        assert str(op.id) not in ledger.calls

        with engine.begin() as connection:
            grant_approval(connection, op.id, approved_by="a@example.com", ttl=timedelta(minutes=5))
        await eventually(
            in_state(database_url, op.id, S.COMMITTED), within=20, what="executed after the grant"
        )

    assert ledger.calls.count(str(op.id)) == 1


async def test_a_prepared_operation_whose_message_was_lost_is_queued_again(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    lost = decide(engine, registry)  # its message was dead-lettered an hour ago
    pending = decide(engine, registry, payment_id="pay_2")  # its row is still unpublished
    fresh = decide(engine, registry, payment_id="pay_3")  # published a moment ago
    waiting = decide(engine, registry, payment_id="pay_4", amount_cents=75_000)
    hour_ago = "now() - interval '1 hour'"
    execute_admin(
        database_url,
        f"UPDATE outbox SET published_at = {hour_ago} WHERE operation_id = ANY(%s)",
        ([lost.id, waiting.id],),
    )
    execute_admin(
        database_url, "UPDATE outbox SET published_at = now() WHERE operation_id = %s", (fresh.id,)
    )
    execute_admin(
        database_url,
        f"UPDATE operations SET next_attempt_at = {hour_ago} WHERE id = ANY(%s)",
        ([lost.id, pending.id, fresh.id, waiting.id],),
    )
    execute_admin(
        database_url,
        "INSERT INTO operation_events (operation_id, name, attributes) "
        "VALUES (%s, 'operation.approval_required', '{}')",
        (waiting.id,),
    )
    sweeping = fast.model_copy(update={"requeue_stale_after": timedelta(minutes=1)})
    consumer = Consumer(sweeping, registry)
    try:
        requeued = await consumer.reconciler.requeue_stale()
        again = await consumer.reconciler.requeue_stale()
    finally:
        await consumer.close()

    assert requeued == [lost.id]
    assert again == []  # its new row is pending now
    assert event_names(database_url, lost.id)[-1] == "operation.requeued"
    async with running_dispatcher(fast), running_consumer(fast, registry):
        await eventually(
            in_state(database_url, lost.id, S.COMMITTED), within=20, what="the lost one executed"
        )
    assert ledger.calls.count(str(lost.id)) == 1


async def test_an_unforeseen_database_failure_leaves_the_message_for_later(
    fast: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    op = decide(engine, registry)
    await Dispatcher(fast).drain()  # the message waits in the queue
    # A schema that suddenly lacks its table is no transient error, and no effect may
    # come of it; the message must survive it.
    execute_admin(database_url, "ALTER TABLE operations RENAME TO operations_away")
    try:
        async with running_consumer(fast, registry):

            async def failed() -> bool:
                return logged(caplog, "consumer.delivery_failed", error="SchemaMissing")

            await eventually(failed, within=20, what="the delivery to fail")
            assert ledger.calls == []
            execute_admin(database_url, "ALTER TABLE operations_away RENAME TO operations")
            await eventually(
                in_state(database_url, op.id, S.COMMITTED), within=20, what="executed afterwards"
            )
    finally:
        execute_admin(database_url, "ALTER TABLE IF EXISTS operations_away RENAME TO operations")
    assert ledger.calls == [str(op.id)]


async def test_a_worker_whose_lease_ran_out_before_the_call_does_not_call(
    fast: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    op = decide(engine, registry)
    envelope = OperationMessage(
        operation_id=op.id,
        outbox_id=1,
        tool=op.tool_name,
        tool_version=op.tool_version,
        input_fingerprint=op.input_fingerprint,
    )
    consumer = Consumer(fast, registry)
    try:
        claimed = await consumer.claim(envelope)
        assert isinstance(claimed, Claimed)
        # As if the process stalled between its claim and the call for the whole lease.
        stalled = dataclasses.replace(claimed, lease_safe_until=time.monotonic() - 0.001)
        attempt = await consumer.attempt(stalled)
        await consumer.record(stalled, attempt)
    finally:
        await consumer.close()

    assert (attempt.outcome, attempt.code) == (AttemptOutcome.NOT_SENT, LEASE_LOST_BEFORE_CALL)
    assert ledger.calls == []
    after = operation(database_url, op.id)
    assert (after.state, after.last_error_class) == (S.PREPARED, "lease_lost_before_call")
    assert event_names(database_url, op.id)[-1] == "operation.retry_scheduled"
    async with running_dispatcher(fast), running_consumer(fast, registry):
        await eventually(
            in_state(database_url, op.id, S.COMMITTED), within=20, what="the retry executed"
        )
    assert ledger.calls == [str(op.id)]


@pytest.mark.parametrize(
    "failure",
    [
        # What SQLAlchemy raises when it cannot open a connection for a transaction.
        sqlalchemy.exc.OperationalError("connect", {}, OSError("connection refused")),
        RuntimeError("a failure nobody foresaw"),
    ],
    ids=["database_unreachable", "unforeseen"],
)
async def test_the_reconciler_outlives_a_failed_pass(
    fast: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    failure: Exception,
) -> None:
    failures_left = [3]
    real_pass = Reconciler.reconcile_once

    async def failing_at_first(self: Reconciler) -> int:
        if failures_left[0]:
            failures_left[0] -= 1
            raise failure
        return await real_pass(self)

    monkeypatch.setattr(Reconciler, "reconcile_once", failing_at_first)
    ledger.faults.append("drop_response")
    op = decide(engine, registry)

    await settle(fast, registry, database_url, op.id, S.COMMITTED)

    assert failures_left == [0]
    assert ledger.calls == [str(op.id)]
    assert event_names(database_url, op.id)[-1] == "operation.reconciled"


async def test_a_blind_replay_claimed_after_its_dedupe_window_goes_to_a_person(
    fast: Settings, ledger: Ledger, engine: Any, database_url: str
) -> None:
    # A deduplicated write with no lookup is retried by replaying its key, which is safe
    # only while the target remembers the key; this replay was decided in time, but is
    # delivered after the window.
    registry = Registry()
    registry.register(
        ToolContract(
            name="send_refund",
            version=1,
            input_model=RefundInput,
            side_effect=SideEffect.DEDUPLICATED_WRITE,
            execute=ledger.refund,
            dedupe_window=timedelta(minutes=5),
            deadline=timedelta(seconds=2),
        )
    )
    op = decide(engine, registry)
    envelope = OperationMessage(
        operation_id=op.id,
        outbox_id=1,
        tool=op.tool_name,
        tool_version=op.tool_version,
        input_fingerprint=op.input_fingerprint,
    )
    with engine.begin() as connection:
        runner = Store(connection)
        claimed = runner.run(store.claim(op.id, owner="w", lease=timedelta(minutes=1)))
        assert claimed is not None
        unknown = runner.run(
            store.transition(
                op.id,
                source=S.IN_FLIGHT,
                target=S.OUTCOME_UNKNOWN,
                lease_token=claimed.lease_token,
                error_class="response_lost",
            )
        )
        runner.run(
            store.transition(
                op.id, source=S.OUTCOME_UNKNOWN, target=S.PREPARED, lease_token=unknown.lease_token
            )
        )
    execute_admin(
        database_url,
        "UPDATE operations SET first_attempt_at = now() - interval '5 minutes' WHERE id = %s",
        (op.id,),
    )
    consumer = Consumer(fast, registry)
    try:
        skipped = await consumer.claim(envelope)
    finally:
        await consumer.close()

    assert isinstance(skipped, Skip)
    assert skipped.result == "escalated"
    assert ledger.calls == []
    after = operation(database_url, op.id)
    assert after.state is S.ESCALATED
    assert event_names(database_url, op.id)[-1] == "operation.escalated"
    assert (
        counter_value(
            consumer,
            "outbox_escalations_total",
            tool="send_refund",
            reason="dedupe_window_passed",
        )
        == 1
    )


def envelope_of(op: Any) -> OperationMessage:
    return OperationMessage(
        operation_id=op.id,
        outbox_id=1,
        tool=op.tool_name,
        tool_version=op.tool_version,
        input_fingerprint=op.input_fingerprint,
    )


async def test_a_burst_is_claimed_by_one_statement_that_reads_nothing_first(
    fast: Settings,
    registry: Registry,
    engine: Any,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    burst = [decide(engine, registry, payment_id=f"pay_{n}") for n in range(3)]
    consumer = Consumer(fast, registry)
    try:
        await consumer.database.run(store.fingerprint_key())
        caplog.set_level(logging.DEBUG, logger="outbox.store")
        # Submitted together, claimed together: one burst, one transaction.
        verdicts = await asyncio.gather(*(consumer.claim(envelope_of(op)) for op in burst))
    finally:
        await consumer.close()

    assert [type(verdict) for verdict in verdicts] == [Claimed] * 3
    ran = [str(getattr(record, "query", "")) for record in records_of(caplog, "store.statement")]
    assert ran == ["claim_deliveries"]
    for op, verdict in zip(burst, verdicts, strict=True):
        assert isinstance(verdict, Claimed)
        assert verdict.operation == operation(database_url, op.id)
        assert event_names(database_url, op.id) == ["operation.prepared", "operation.attempted"]


async def test_a_tampered_row_in_a_burst_is_escalated_and_the_rest_claimed_once(
    fast: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    good = decide(engine, registry)
    forged = decide(engine, registry, payment_id="pay_2")
    # The input changed behind the fingerprint: the message and the row still agree,
    # so the set-based claim takes it, and the check after it must undo that.
    execute_admin(
        database_url, "ALTER TABLE operations DISABLE TRIGGER operations_guard_transition"
    )
    try:
        execute_admin(
            database_url,
            "UPDATE operations SET input = jsonb_set(input, '{amount_cents}', '999') WHERE id = %s",
            (forged.id,),
        )
    finally:
        execute_admin(
            database_url, "ALTER TABLE operations ENABLE TRIGGER operations_guard_transition"
        )
    consumer = Consumer(fast, registry)
    try:
        verdicts = await asyncio.gather(
            *(consumer.claim(envelope_of(op)) for op in (good, forged, good))
        )
    finally:
        await consumer.close()

    claimed, tampered, duplicate = verdicts
    assert isinstance(claimed, Claimed)
    assert claimed.operation == operation(database_url, good.id)
    assert (tampered, duplicate) == (Skip("tampered"), Skip("duplicate"))
    assert event_names(database_url, good.id) == [
        "operation.prepared",
        "operation.attempted",
        "operation.delivery_suppressed",
    ]
    # Nothing of the claim that was rolled back: no attempt, no lease.
    assert event_names(database_url, forged.id) == [
        "operation.prepared",
        "operation.tampered",
        "operation.escalated",
    ]
    after = operation(database_url, forged.id)
    assert (after.state, after.attempts, after.lease_token) == (S.ESCALATED, 0, 0)


async def test_a_message_that_lies_about_an_operation_claimed_beside_it_is_refused(
    fast: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    first, second = decide(engine, registry), decide(engine, registry, payment_id="pay_2")
    truthful = [envelope_of(first), envelope_of(second)]
    lies = [
        truthful[0].model_copy(update={"input_fingerprint": "0" * 64}),
        truthful[1].model_copy(update={"tool": "open_ticket"}),
    ]
    consumer = Consumer(fast, registry)
    try:
        # One burst: the truth before the lie about the first, after it about the second.
        verdicts = await asyncio.gather(
            *(consumer.claim(envelope) for envelope in (truthful[0], lies[0], lies[1], truthful[1]))
        )
    finally:
        await consumer.close()

    mismatch = Skip("invalid", "envelope_mismatch")
    assert verdicts[1] == verdicts[2] == mismatch
    for op, verdict in ((first, verdicts[0]), (second, verdicts[3])):
        assert isinstance(verdict, Claimed)
        assert verdict.operation == operation(database_url, op.id)
        assert event_names(database_url, op.id) == ["operation.prepared", "operation.attempted"]
