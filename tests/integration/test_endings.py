"""Every decision reaches one of the three endings, even when nothing would move it:
a denied approval ends rejected, an operation no consumer can run is escalated after a
few requeues, with the reason its messages were dead-lettered as evidence."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from consumer.worker import Consumer
from outbox import OperationState, Registry, Settings, record_decision
from outbox import store as outbox_store
from outbox.broker import OperationMessage
from outbox.contracts import Registry as ToolRegistry
from outbox.contracts import RetryPolicy, SideEffect, ToolContract
from outbox.models import ApprovalDecision

from support.consume_helpers import event_names, events, in_state, operation, running_consumer
from support.db_helpers import execute_admin
from support.dispatch_helpers import counter_value, running_dispatcher
from support.ops_helpers import Ops
from support.sample_tools import Ledger, RefundInput, build_registry
from support.waiting import eventually

S = OperationState
HOUR_AGO = "now() - interval '1 hour'"


def decide(engine: Any, registry: Registry, tool: str = "send_refund", **fields: Any) -> Any:
    tool_input = (
        {"payment_id": "pay_1", "amount_cents": 100, **fields}
        if tool == "send_refund"
        else {"title": "t", **fields}
    )
    with engine.begin() as connection:
        return record_decision(connection, registry, tool, tool_input, run_id="run").operation


def sweeping(settings: Settings, **changes: Any) -> Settings:
    return settings.model_copy(update={"requeue_stale_after": timedelta(minutes=1), **changes})


def messages_long_gone(database_url: str, *operation_ids: Any) -> None:
    """As if each operation's message was published an hour ago and dead-lettered."""
    execute_admin(
        database_url,
        f"UPDATE outbox SET published_at = {HOUR_AGO} WHERE operation_id = ANY(%s)",
        (list(operation_ids),),
    )
    execute_admin(
        database_url,
        f"UPDATE operations SET next_attempt_at = {HOUR_AGO} WHERE id = ANY(%s)",
        (list(operation_ids),),
    )


async def sweep(settings: Settings, registry: Registry) -> Consumer:
    consumer = Consumer(settings, registry)
    try:
        await consumer.requeue_stale()
    finally:
        await consumer.close()
    return consumer


async def test_a_denial_with_no_grant_after_it_ends_rejected(
    settings: Settings, registry: Registry, ledger: Ledger, engine: Any, database_url: str
) -> None:
    ops = Ops(database_url, registry)
    denied = decide(engine, registry, amount_cents=60_000)
    regranted = decide(engine, registry, payment_id="pay_2", amount_cents=60_000)
    recent = decide(engine, registry, payment_id="pay_3", amount_cents=60_000)
    for target in (denied, regranted, recent):
        ops.run(
            outbox_store.decide_approval(
                target.id, decision=ApprovalDecision.DENIED, approved_by="lead",
                ttl=timedelta(hours=1),
            )
        )  # fmt: skip
    ops.run(
        outbox_store.decide_approval(
            regranted.id, decision=ApprovalDecision.GRANTED, approved_by="lead",
            ttl=timedelta(hours=1),
        )
    )  # fmt: skip
    execute_admin(
        database_url,
        f"UPDATE approvals SET created_at = {HOUR_AGO} WHERE operation_id = ANY(%s)",
        ([denied.id, regranted.id],),
    )
    execute_admin(
        database_url,
        "UPDATE approvals SET created_at = now() WHERE operation_id = %s AND decision = 'granted'",
        (regranted.id,),
    )

    await sweep(sweeping(settings, approval_denial_grace=timedelta(minutes=15)), registry)

    assert operation(database_url, denied.id).state is S.REJECTED
    rejected = events(database_url, denied.id)[-1]
    assert (rejected.name, rejected.attributes["policy"]) == (
        "operation.rejected",
        "approval_denied",
    )
    # A grant after the denial, or a denial still inside its grace: still prepared.
    assert operation(database_url, regranted.id).state is S.PREPARED
    assert operation(database_url, recent.id).state is S.PREPARED
    assert ledger.calls == []


def a_ticket_no_consumer_runs(
    engine: Any, database_url: str
) -> tuple[ToolRegistry, Any, OperationMessage]:
    """An open_ticket decision, its message, and consumers' registry that has only
    send_refund: every consumer turns the message away."""
    everything = build_registry()
    refunds_only = ToolRegistry()
    refunds_only.register(everything.get("send_refund"))
    orphan = decide(engine, everything, tool="open_ticket")
    row = operation(database_url, orphan.id)
    envelope = OperationMessage(
        operation_id=orphan.id,
        outbox_id=1,
        tool=row.tool_name,
        tool_version=row.tool_version,
        input_fingerprint=row.input_fingerprint,
    )
    return refunds_only, orphan, envelope


async def test_an_operation_no_consumer_can_run_is_escalated_after_its_requeues(
    settings: Settings, engine: Any, database_url: str
) -> None:
    refunds_only, orphan, envelope = a_ticket_no_consumer_runs(engine, database_url)
    consumer_settings = sweeping(settings, undeliverable_after_requeues=2)
    cycles = 0
    while operation(database_url, orphan.id).state is S.PREPARED:
        assert cycles < 5, "the operation was requeued forever"
        # A consumer without the tool turns each of its messages away to the dead letters.
        consumer = Consumer(consumer_settings, refunds_only)
        try:
            verdict = await consumer.claim(envelope)
        finally:
            await consumer.close()
        assert getattr(verdict, "dead_letter_reason", None) == "unknown_tool"
        messages_long_gone(database_url, orphan.id)
        consumer = await sweep(consumer_settings, refunds_only)
        cycles += 1

    assert cycles == 3  # two requeues, then the escalation
    assert operation(database_url, orphan.id).state is S.ESCALATED
    names = event_names(database_url, orphan.id)
    assert names.count("operation.requeued") == 2
    assert names.count("operation.dead_lettered") == 3
    escalation = events(database_url, orphan.id)[-1]
    assert escalation.name == "operation.escalated"
    assert escalation.attributes == {
        "from": "prepared",
        "to": "escalated",
        "reason": "undeliverable",
        "requeues": 2,
        "refusals": 3,
        "last_dead_letter": "unknown_tool",
    }
    assert (
        counter_value(
            consumer,
            "outbox_escalations_total",
            tool="open_ticket",
            reason="undeliverable",
        )
        == 1
    )


async def test_requeues_with_no_refusal_never_escalate(
    settings: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    # Messages that met only our own timeouts or an unavailable database: the sweep
    # queues the operation again as often as it goes stale, and never hands it to a
    # person, since no consumer ever said it cannot run it.
    slow = decide(engine, registry)
    consumer_settings = sweeping(settings, undeliverable_after_requeues=2)
    for _ in range(4):
        messages_long_gone(database_url, slow.id)
        await sweep(consumer_settings, registry)
    assert operation(database_url, slow.id).state is S.PREPARED
    assert event_names(database_url, slow.id).count("operation.requeued") == 4


async def test_an_old_refusal_does_not_escalate_what_is_now_delivered_nowhere(
    settings: Settings, engine: Any, database_url: str
) -> None:
    # Refused by consumers without the tool (a rolling deploy), then requeued while the
    # new consumers could not finish it: the latest message was not refused, so the
    # refusals are no evidence that it is undeliverable now.
    refunds_only, orphan, envelope = a_ticket_no_consumer_runs(engine, database_url)
    consumer_settings = sweeping(settings, undeliverable_after_requeues=2)
    for _ in range(2):
        consumer = Consumer(consumer_settings, refunds_only)
        try:
            await consumer.claim(envelope)
        finally:
            await consumer.close()
        messages_long_gone(database_url, orphan.id)
        await sweep(consumer_settings, refunds_only)
    messages_long_gone(database_url, orphan.id)
    await sweep(consumer_settings, refunds_only)
    assert operation(database_url, orphan.id).state is S.PREPARED


@pytest.mark.parametrize("amount_cents", [100, 60_000])
async def test_a_forged_approval_flag_is_never_executed(
    settings: Settings,
    registry: Registry,
    ledger: Ledger,
    engine: Any,
    database_url: str,
    amount_cents: int,
) -> None:
    # The flag the decision was recorded with disagrees with the contract's policy on
    # the stored input: cleared for a refund that needs approval, or set for one that
    # does not. Either way the row was not written by the library.
    forged = decide(engine, registry, amount_cents=amount_cents)
    execute_admin(
        database_url,
        "ALTER TABLE operations DISABLE TRIGGER operations_guard_transition",
    )
    try:
        execute_admin(
            database_url,
            "UPDATE operations SET requires_approval = NOT requires_approval WHERE id = %s",
            (forged.id,),
        )
    finally:
        execute_admin(
            database_url, "ALTER TABLE operations ENABLE TRIGGER operations_guard_transition"
        )
    row = operation(database_url, forged.id)
    envelope = OperationMessage(
        operation_id=forged.id, outbox_id=1, tool=row.tool_name, tool_version=row.tool_version,
        input_fingerprint=row.input_fingerprint,
    )  # fmt: skip
    consumer = Consumer(settings, registry)
    try:
        verdict = await consumer.claim(envelope)
    finally:
        await consumer.close()

    assert getattr(verdict, "result", None) == "tampered"
    assert operation(database_url, forged.id).state is S.ESCALATED
    tampered = [e for e in events(database_url, forged.id) if e.name == "operation.tampered"]
    assert [e.attributes["check"] for e in tampered] == ["approval_flag_mismatch"]
    assert ledger.calls == []


async def test_a_possible_effect_then_only_attempts_that_never_left_goes_to_a_person(
    settings: Settings, ledger: Ledger, engine: Any, database_url: str
) -> None:
    # An idempotent write with no lookup: the first attempt lands and loses its answer,
    # the blind retries never leave. "Rejected" would tell the agent "not done".
    registry = ToolRegistry()
    registry.register(
        ToolContract(
            name="send_refund",
            version=1,
            input_model=RefundInput,
            side_effect=SideEffect.IDEMPOTENT_WRITE,
            execute=ledger.refund,
            retry=RetryPolicy(
                max_attempts=3,
                initial_backoff=timedelta(milliseconds=50),
                max_backoff=timedelta(milliseconds=100),
            ),
            deadline=timedelta(seconds=2),
        )
    )
    ledger.faults.extend(["drop_response", "not_sent_here", "not_sent_here"])
    op = decide(engine, registry)
    fast = settings.model_copy(update={"reconcile_interval": 0.05, "lease_margin": 0.5})

    async with running_dispatcher(fast), running_consumer(fast, registry) as consumer:
        await eventually(
            in_state(database_url, op.id, S.ESCALATED, S.REJECTED), within=30, what="an ending"
        )

    final = operation(database_url, op.id)
    assert final.state is S.ESCALATED
    assert final.effect_possible
    assert final.attempts == 3
    assert ledger.calls == [str(op.id)] * 3
    assert list(ledger.refunds) == [str(op.id)]  # the one effect, from the first attempt
    names = event_names(database_url, op.id)
    assert "operation.rejected" not in names
    assert names == [
        "operation.prepared",
        "operation.attempted",
        "operation.outcome_unknown",
        "operation.retry_scheduled",
        "operation.attempted",
        "operation.retry_scheduled",
        "operation.attempted",
        "operation.outcome_unknown",
        "operation.escalated",
    ]
    escalated = events(database_url, op.id)[-1].attributes
    assert escalated["reason"] == "effect_possible"
    assert escalated["last_error"] == "pool_timeout"
    assert (
        counter_value(
            consumer, "outbox_escalations_total", tool="send_refund", reason="effect_possible"
        )
        == 1
    )


def published_ago(database_url: str, seconds: float, *operation_ids: Any) -> None:
    """As if each operation's message went out ``seconds`` ago and nothing led anywhere."""
    execute_admin(
        database_url,
        "UPDATE outbox SET published_at = clock_timestamp() - make_interval(secs => %s) "
        "WHERE operation_id = ANY(%s)",
        (seconds, list(operation_ids)),
    )
    execute_admin(
        database_url,
        f"UPDATE operations SET next_attempt_at = {HOUR_AGO} WHERE id = ANY(%s)",
        (list(operation_ids),),
    )


async def requeued_by_one_sweep(settings: Settings, registry: Registry) -> set[Any]:
    consumer = Consumer(settings, registry)
    try:
        return set(await consumer.requeue_stale())
    finally:
        await consumer.close()


async def test_a_message_waiting_in_a_slow_queue_is_not_sent_again(
    settings: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    # Stale period 60 s: each of these went out longer ago than that, and no consumer
    # has taken anything up since, as behind a backlog.
    behind = [decide(engine, registry, payment_id=f"pay_{n}") for n in range(3)]
    published_ago(database_url, 90, *(op.id for op in behind))
    sweeper = sweeping(settings)

    assert await requeued_by_one_sweep(sweeper, registry) == set()
    assert all("operation.requeued" not in event_names(database_url, op.id) for op in behind)

    # A consumer takes up an operation whose message went out 40 s after theirs: the
    # queue has moved past them, so their messages are gone.
    later = decide(engine, registry, payment_id="pay_later")
    published_ago(database_url, 50, later.id)
    execute_admin(database_url, "UPDATE operations SET attempts = 1 WHERE id = %s", (later.id,))

    assert await requeued_by_one_sweep(sweeper, registry) == {op.id for op in behind}


async def test_a_message_only_just_behind_what_consumers_read_is_left_waiting(
    settings: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    # Two dispatchers mark their batches a little out of order, and a consumer's
    # prefetch holds a few messages: within half the stale period is no evidence.
    close_behind = decide(engine, registry)
    published_ago(database_url, 70, close_behind.id)
    taken = decide(engine, registry, payment_id="pay_taken")
    published_ago(database_url, 50, taken.id)
    execute_admin(database_url, "UPDATE operations SET attempts = 1 WHERE id = %s", (taken.id,))

    assert await requeued_by_one_sweep(sweeping(settings), registry) == set()


async def test_a_refused_message_or_one_gone_three_periods_is_sent_again(
    settings: Settings, registry: Registry, engine: Any, database_url: str
) -> None:
    refused, long_gone, waiting = (
        decide(engine, registry, payment_id=f"pay_{n}") for n in range(3)
    )
    published_ago(database_url, 90, refused.id, waiting.id)
    published_ago(database_url, 181, long_gone.id)
    execute_admin(
        database_url,
        "INSERT INTO operation_events (operation_id, name, attributes) "
        "VALUES (%s, 'operation.dead_lettered', '{\"reason\": \"unknown_tool\"}')",
        (refused.id,),
    )

    assert await requeued_by_one_sweep(sweeping(settings), registry) == {refused.id, long_gone.id}
