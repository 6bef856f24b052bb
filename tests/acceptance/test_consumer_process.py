"""The guarantee end to end: daemons as subprocesses, the payment sandbox over HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from datetime import timedelta

import psycopg
import pytest

from outbox import OperationState, Settings, grant_approval
from outbox.sandbox.provider import Faults

from support.broker_helpers import read_raw, wait_for_dead_letter_queue
from support.consume_helpers import publish_raw
from support.system import SETTLED, System, running_system
from support.waiting import eventually_sync

S = OperationState


def refunds_in_ledger(system: System) -> int:
    return int(system.provider.ledger()["totals"]["refunds"])


def test_a_lost_response_ends_in_one_refund(settings: Settings) -> None:
    with running_system(settings, faults=Faults(drop_response_every=1)) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide()
        final = system.wait_for(op.id, *SETTLED)

        assert final.state is S.COMMITTED
        assert system.refunds_for(op.id) == 1
        ledger_refund = system.provider.ledger()["refunds"][0]
        assert final.provider_reference == ledger_refund["id"]
        assert system.events(op.id) == [
            "operation.prepared",
            "operation.attempted",
            "operation.outcome_unknown",
            "operation.reconciled",
        ]


def test_a_failure_before_commit_is_retried_into_one_refund(settings: Settings) -> None:
    with running_system(settings, faults=Faults(fail_before_commit_every=1)) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide()
        eventually_sync(
            lambda: "operation.outcome_unknown" in system.events(op.id),
            within=20,
            what="the 503 recorded as an unknown outcome",
        )
        system.provider.set_faults(fail_before_commit_every=0)
        final = system.wait_for(op.id, *SETTLED)

        assert final.state is S.COMMITTED
        assert final.attempts == 2
        assert system.refunds_for(op.id) == 1
        assert "operation.reconciled" in system.events(op.id)  # proven absent before retry


def test_a_definitive_rejection_is_final(settings: Settings) -> None:
    with running_system(settings, payment_amount_cents=10_000) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide(amount_cents=20_000)  # more than the payment captured
        final = system.wait_for(op.id, *SETTLED)

        assert final.state is S.REJECTED
        assert final.last_error_class == "amount_exceeds_payment"
        assert refunds_in_ledger(system) == 0
        assert system.events(op.id).count("operation.attempted") == 1


def test_lookups_that_stay_unavailable_wait_out_the_tolerance_then_escalate_without_a_second_post(
    settings: Settings,
) -> None:
    faults = Faults(drop_response_every=1, lookups_unavailable=True)
    with running_system(settings, faults=faults, outage_tolerance=8.0) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide()
        final = system.wait_for(op.id, *SETTLED, within=45)

        assert final.state is S.ESCALATED
        # A lookup that could not ask costs none of the contract's five: time ran out.
        assert final.reconcile_attempts == 0
        assert final.last_error_class == "provider_unavailable"
        assert system.refunds_for(op.id) == 1
        events = system.events(op.id)
        assert events.count("operation.attempted") == 1
        assert events.count("operation.reconcile_deferred") == 0
        assert events[-1] == "operation.escalated"


def test_a_non_repeatable_write_without_lookup_escalates_at_once(settings: Settings) -> None:
    with running_system(settings, faults=Faults(drop_response_every=1)) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide(
            "send_email", to="customer@example.com", subject="Your refund", body="Hello"
        )
        final = system.wait_for(op.id, *SETTLED)

        assert final.state is S.ESCALATED
        assert system.provider.ledger()["totals"]["emails"] == 1
        assert system.events(op.id)[-2:] == ["operation.outcome_unknown", "operation.escalated"]


def test_a_consumer_killed_between_commit_and_record_is_reconciled(settings: Settings) -> None:
    # The provider commits at once and answers after 3.5 s; the tool's deadline is 3 s.
    with running_system(settings, faults=Faults(delay_ms=3500), refund_deadline=3.0) as system:
        system.start("dispatcher")
        victim = system.start("consumer")
        op = system.decide()
        eventually_sync(
            lambda: system.refunds_for(op.id) == 1, within=20, what="the provider to commit"
        )
        victim.kill()
        assert system.operation(op.id).state is S.IN_FLIGHT  # nobody recorded the outcome

        system.start("consumer")
        final = system.wait_for(op.id, *SETTLED, within=30)

        assert final.state is S.COMMITTED
        assert system.refunds_for(op.id) == 1
        names = system.events(op.id)
        assert names.count("operation.attempted") == 1
        assert "operation.outcome_unknown" in names
        assert names[-1] == "operation.reconciled"


def test_a_consumer_killed_mid_chunk_leaves_each_entry_one_refund(settings: Settings) -> None:
    # Sixteen decisions waiting when the dispatcher starts: one batch, sent as four
    # chunks of four. The provider commits each at once and answers after 12 s, past the
    # tool's deadline of 10 s: long enough for a busy machine to start every call first.
    with running_system(settings, faults=Faults(delay_ms=12_000), refund_deadline=10.0) as system:
        system.environment["OUTBOX_MESSAGE_OPERATIONS"] = "4"
        ops = [system.decide(payment_id=f"pay_chunk_{n}") for n in range(16)]
        system.start("dispatcher")
        victim = system.start("consumer")
        eventually_sync(
            lambda: all(system.refunds_for(op.id) == 1 for op in ops),
            within=30,
            what="the provider to commit every refund",
        )
        victim.kill()
        assert {system.operation(op.id).state for op in ops} == {S.IN_FLIGHT}

        system.start("consumer")
        finals = [system.wait_for(op.id, *SETTLED, within=90) for op in ops]

        assert {final.state for final in finals} == {S.COMMITTED}
        for op in ops:
            assert system.refunds_for(op.id) == 1
            names = system.events(op.id)
            assert names.count("operation.attempted") == 1
            assert names[-1] == "operation.reconciled"
        assert system.provider.ledger()["totals"]["refunds"] == 16


def test_a_zombie_worker_is_fenced_off(settings: Settings) -> None:
    with running_system(settings, faults=Faults(delay_ms=2500), refund_deadline=2.0) as system:
        system.start("dispatcher")
        zombie = system.start("consumer")
        op = system.decide()
        eventually_sync(
            lambda: system.refunds_for(op.id) == 1, within=20, what="the provider to commit"
        )
        zombie.signal(signal.SIGSTOP)  # paused past its lease, mid-call

        system.start("consumer")
        final = system.wait_for(op.id, *SETTLED, within=30)
        assert final.state is S.COMMITTED

        zombie.signal(signal.SIGCONT)
        # It wakes past its deadline, its call is cut, and it tries to record that.
        zombie.wait_for_line("consumer.write_fenced")
        assert system.operation(op.id) == final  # its late write changed nothing
        assert system.refunds_for(op.id) == 1


def test_the_same_message_published_twice_executes_once(
    settings: Settings, amqp_server_url: str
) -> None:
    with running_system(settings) as system:
        system.start("consumer")
        op = system.decide()
        body = json.dumps(
            {
                "v": 1,
                "operation_id": str(op.id),
                "outbox_id": 1,
                "tool": op.tool_name,
                "tool_version": op.tool_version,
                "input_fingerprint": op.input_fingerprint,
            }
        ).encode()

        async def publish_twice() -> None:
            # Declared by the consumer at start; publish only once it is there.
            for _ in range(2):
                await publish_raw(amqp_server_url, settings.exchange, body)

        eventually_sync(lambda: system.daemons[0].running(), within=5, what="consumer up")
        wait_for_consumer(amqp_server_url, settings.queue)
        asyncio.run(publish_twice())
        final = system.wait_for(op.id, *SETTLED)
        output = system.daemons[0].output()
        assert system.refunds_for(op.id) == 1

    assert final.state is S.COMMITTED
    assert system.events(op.id).count("operation.attempted") == 1
    assert "consumer.dead_lettered" not in output


def wait_for_consumer(amqp_url: str, queue: str) -> None:
    import aio_pika

    # The consumer declares its queue, binds it, then consumes: a consumer on the queue
    # means a message published to the exchange is routed to it.
    async def consumed() -> bool:
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            try:
                declared = await channel.declare_queue(queue, passive=True)
            except aio_pika.exceptions.ChannelClosed:
                return False
            return (declared.declaration_result.consumer_count or 0) > 0

    eventually_sync(lambda: asyncio.run(consumed()), within=20, what=f"a consumer on queue {queue}")


def test_approval_gates_the_refund_and_binds_to_the_amount(settings: Settings) -> None:
    with running_system(settings) as system:
        system.start("dispatcher")
        system.start("consumer")
        op = system.decide(amount_cents=75_000)
        other = system.decide(amount_cents=80_000)
        eventually_sync(
            lambda: "operation.approval_required" in system.events(op.id),
            within=20,
            what="the refund to wait for approval",
        )
        with psycopg.connect(system.database_url) as connection:
            # A grant for another amount, then an expired one: both refused.
            grant_approval(
                connection,
                op.id,
                approved_by="oncall@example.com",
                ttl=timedelta(minutes=5),
                intent_hash=other.input_fingerprint,
            )
            connection.commit()
        eventually_sync(
            lambda: system.events(op.id).count("operation.approval_required") == 2,
            within=20,
            what="the changed-intent grant refused",
        )
        with psycopg.connect(system.database_url) as connection:
            grant_approval(
                connection,
                op.id,
                approved_by="oncall@example.com",
                ttl=timedelta(microseconds=1),
            )
            connection.commit()
        eventually_sync(
            lambda: system.events(op.id).count("operation.approval_required") == 3,
            within=20,
            what="the expired grant refused",
        )
        assert system.refunds_for(op.id) == 0

        with psycopg.connect(system.database_url) as connection:
            grant_approval(
                connection, op.id, approved_by="oncall@example.com", ttl=timedelta(minutes=5)
            )
            connection.commit()
        final = system.wait_for(op.id, S.COMMITTED)

        assert final.state is S.COMMITTED
        assert system.refunds_for(op.id) == 1
        assert system.operation(other.id).state is S.PREPARED  # never approved, never run


@pytest.mark.timeout(240)
def test_a_thousand_decisions_under_faults_give_one_refund_each(settings: Settings) -> None:
    faults = Faults(seed=7, drop_response_probability=0.20, fail_before_commit_probability=0.10)
    decisions = 1000
    with running_system(settings, faults=faults, refund_deadline=5.0) as system:
        for kind in ("dispatcher", "dispatcher", "consumer", "consumer"):
            system.start(kind)
        with psycopg.connect(system.database_url) as connection:
            from outbox import record_decision

            for n in range(decisions):
                record_decision(
                    connection,
                    system.registry,
                    "send_refund",
                    {"payment_id": f"pay_{n}", "amount_cents": 100 + n},
                    run_id="load",
                    decision_key=f"call_{n}",
                )
                if n % 50 == 49:
                    connection.commit()
            connection.commit()

        def settled_count() -> int:
            with psycopg.connect(system.database_url) as connection:
                row = connection.execute(
                    "SELECT count(*) FROM operations "
                    "WHERE state IN ('committed', 'rejected', 'escalated')"
                ).fetchone()
                assert row is not None
                return int(row[0])

        eventually_sync(
            lambda: settled_count() == decisions, within=200, what="every operation settled"
        )
        with psycopg.connect(system.database_url) as connection:
            states: Counter[str] = Counter(
                {
                    str(state): int(count)
                    for state, count in connection.execute(
                        "SELECT state, count(*) FROM operations GROUP BY state"
                    )
                }
            )
            ids_by_state: dict[str, set[str]] = {}
            for operation_id, state in connection.execute("SELECT id, state FROM operations"):
                ids_by_state.setdefault(str(state), set()).add(str(operation_id))
            escalation_reasons = Counter(
                f"{reason}/{last_error}"
                for reason, last_error in connection.execute(
                    "SELECT attributes->>'reason', attributes->>'last_error' "
                    "FROM operation_events WHERE name = 'operation.escalated'"
                )
            )
            opened = connection.execute(
                "SELECT count(*) FROM operation_events WHERE name = 'operation.outcome_unknown'"
            ).fetchone()
            unknown_opened = int(opened[0]) if opened else 0
        ledger = system.provider.ledger()

    by_key = Counter({key: int(n) for key, n in ledger["refunds_by_key"].items()})
    duplicates = sum(n - 1 for n in by_key.values() if n > 1)
    print(
        f"\ndecisions={decisions} committed={states['committed']} rejected={states['rejected']} "
        f"escalated={states['escalated']} ledger_refunds={ledger['totals']['refunds']} "
        f"duplicate_effects={duplicates} outcome_unknown_opened={unknown_opened}"
    )
    print(f"escalations by reason/last error: {dict(escalation_reasons)}")
    assert duplicates == 0
    committed = ids_by_state.get("committed", set())
    # Every committed operation has its one refund; a refund exists only for a committed
    # operation or one escalated to a person (an unknown outcome it could not settle).
    assert committed <= set(by_key)
    assert set(by_key) <= committed | ids_by_state.get("escalated", set())
    assert sum(states.values()) == decisions


def test_poison_messages_are_dead_lettered_with_no_effect(
    settings: Settings, amqp_server_url: str
) -> None:
    with running_system(settings) as system:
        consumer = system.start("consumer")
        op = system.decide()
        envelope = {
            "v": 1,
            "operation_id": str(op.id),
            "outbox_id": 1,
            "tool": op.tool_name,
            "tool_version": op.tool_version,
            "input_fingerprint": op.input_fingerprint,
        }
        poison = [
            b"garbage \xff canary-poison-1",
            json.dumps({**envelope, "tool": "drop_tables", "tool_version": 9}).encode(),
            json.dumps(
                {**envelope, "operation_id": "00000000-0000-4000-8000-000000000000"}
            ).encode(),
        ]
        wait_for_consumer(amqp_server_url, settings.queue)
        asyncio.run(wait_for_dead_letter_queue(amqp_server_url, settings.dead_letter_queue))

        async def publish_all() -> None:
            for body in poison:
                await publish_raw(amqp_server_url, settings.exchange, body, routing_key="x.v1")

        asyncio.run(publish_all())
        dead = asyncio.run(
            read_raw(amqp_server_url, settings.dead_letter_queue, expect=3, within=30)
        )
        output = consumer.output()

    assert sorted(m.body for m in dead) == sorted(poison), output
    assert refunds_in_ledger(system) == 0
    assert system.operation(op.id).state is S.PREPARED
    for reason in ("malformed", "envelope_mismatch", "unknown_operation"):
        assert f"consumer.dead_lettered reason={reason}" in output
    assert "canary-poison-1" not in output


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ("", "no tools modules given"),
        ("no.such.module", "cannot import tools module 'no.such.module': ModuleNotFoundError"),
    ],
)
def test_a_consumer_without_usable_tools_refuses_to_start(tools: str, message: str) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run(
        [str(Path(sys.executable).parent / "outbox"), "consumer"],
        capture_output=True,
        text=True,
        env={**os.environ, "OUTBOX_TOOLS": tools},
        timeout=60,
        check=False,
    )

    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
