"""A chunk's entries do not share each other's fate (#45), against the real Postgres and
RabbitMQ: a slow entry holds no acknowledgement, a failing tool settles only its own
operation, and an entry whose claim raises goes round again alone and is dead-lettered
alone. The consumer killed mid-chunk is in tests/acceptance/test_consumer_process.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest

from consumer.claims import Claimed, Skip
from consumer.worker import Consumer
from outbox import OperationState, Registry, Settings
from outbox.broker import OperationMessage, parse_body
from outbox.contracts import Registry as ContractRegistry
from outbox.outcomes import DefinitiveRejection, EffectResult, ExecutionContext, OutcomeUnknown

from support.broker_helpers import read_raw
from support.consume_helpers import events, in_state, operation, publish_raw, running_consumer
from support.dispatch_helpers import counter_value, record_one
from support.sample_tools import Ledger, RefundInput, refund_contract, ticket_contract
from support.waiting import eventually

S = OperationState


@dataclass
class SteeredLedger(Ledger):
    """The test suite's provider, told per payment what to do: ``gate`` holds the call of
    ``pay_slow`` until set; ``pay_reject`` is refused; ``pay_lost`` commits and loses
    its answer."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def refund(self, refund: RefundInput, ctx: ExecutionContext) -> EffectResult:
        if refund.payment_id == "pay_slow":
            await self.gate.wait()
        if refund.payment_id == "pay_reject":
            self.calls.append(ctx.idempotency_key)
            raise DefinitiveRejection("amount_exceeds_payment")
        if refund.payment_id == "pay_lost":
            self.calls.append(ctx.idempotency_key)
            self.refunds.setdefault(ctx.idempotency_key, refund)
            raise OutcomeUnknown("connection_lost")
        return await super().refund(refund, ctx)


def steered_registry(ledger: SteeredLedger) -> Registry:
    registry = ContractRegistry()
    # A deadline far past the test's steps: the slow call ends when the test says so.
    registry.register(dataclasses.replace(refund_contract(ledger), deadline=timedelta(seconds=60)))
    registry.register(ticket_contract(ledger))
    return registry


def chunked(settings: Settings, **changes: Any) -> Settings:
    return settings.model_copy(
        update={"message_operations": 8, "reconcile_interval": 0.05, **changes}
    )


def chunk_of(database_url: str, *operation_ids: UUID) -> bytes:
    entries = []
    for operation_id in operation_ids:
        op = operation(database_url, operation_id)
        entries.append(
            {
                "operation_id": str(op.id),
                "outbox_id": 1,
                "tool": op.tool_name,
                "tool_version": op.tool_version,
                "input_fingerprint": op.input_fingerprint,
            }
        )
    return json.dumps({"v": 2, "operations": entries}, separators=(",", ":")).encode()


async def test_a_slow_entry_holds_no_acknowledgement(
    settings: Settings, database_url: str, amqp_server_url: str
) -> None:
    ledger = SteeredLedger()
    registry = steered_registry(ledger)
    slow = record_one(database_url, registry, payment_id="pay_slow")
    first = record_one(database_url, registry, payment_id="pay_first")
    later = record_one(database_url, registry, payment_id="pay_later")
    # One message in hand at a time: the second chunk is delivered only once the first
    # is acknowledged, which it must be while its slow entry is still being called.
    async with running_consumer(chunked(settings, prefetch=1), registry):
        await publish_raw(amqp_server_url, settings.exchange, chunk_of(database_url, slow, first))
        await eventually(in_state(database_url, first, S.COMMITTED), within=20, what="first")
        await publish_raw(amqp_server_url, settings.exchange, chunk_of(database_url, later))
        await eventually(in_state(database_url, later, S.COMMITTED), within=20, what="later")
        assert operation(database_url, slow).state is S.IN_FLIGHT
        assert str(slow) not in ledger.refunds

        ledger.gate.set()
        await eventually(in_state(database_url, slow, S.COMMITTED), within=20, what="slow")
    assert sorted(ledger.refunds) == sorted(str(op) for op in (slow, first, later))
    for operation_id in (slow, first, later):
        names = [e.name for e in events(database_url, operation_id)]
        assert names.count("operation.attempted") == 1
    # Nothing went back to the queue or to the dead letters.
    assert await read_raw(amqp_server_url, settings.queue, expect=1, within=1.0) == []
    assert await read_raw(amqp_server_url, settings.dead_letter_queue, expect=1, within=1.0) == []


async def test_a_failing_tool_settles_only_its_own_entry(
    settings: Settings, database_url: str, amqp_server_url: str
) -> None:
    ledger = SteeredLedger()
    registry = steered_registry(ledger)
    rejected = record_one(database_url, registry, payment_id="pay_reject")
    lost = record_one(database_url, registry, payment_id="pay_lost")
    good = record_one(database_url, registry, payment_id="pay_good")
    async with running_consumer(chunked(settings), registry) as consumer:
        await publish_raw(
            amqp_server_url, settings.exchange, chunk_of(database_url, rejected, lost, good)
        )
        await eventually(in_state(database_url, rejected, S.REJECTED), within=20, what="rejected")
        await eventually(in_state(database_url, good, S.COMMITTED), within=20, what="good")
        # The lost answer is looked up, found, and committed: the chunk is not sent round.
        await eventually(in_state(database_url, lost, S.COMMITTED), within=20, what="reconciled")
        processed = counter_value(consumer, "outbox_consumer_deliveries_total", result="processed")
    assert processed == 3
    assert sorted(ledger.calls) == sorted(str(op) for op in (rejected, lost, good))
    assert sorted(ledger.refunds) == sorted([str(lost), str(good)])
    assert [e.name for e in events(database_url, lost)][-1] == "operation.reconciled"
    assert await read_raw(amqp_server_url, settings.queue, expect=1, within=1.0) == []
    assert await read_raw(amqp_server_url, settings.dead_letter_queue, expect=1, within=1.0) == []


class ClaimBroken(Exception):
    """What a bug in the claim of one operation raises: not the database being away."""


def breaking_claims_of(
    consumer: Consumer, broken: UUID
) -> Callable[[OperationMessage], Coroutine[Any, Any, Claimed | Skip]]:
    claim = consumer.claims.claim

    async def claim_or_break(envelope: OperationMessage) -> Claimed | Skip:
        if envelope.operation_id == broken:
            raise ClaimBroken("the claim of this operation fails every time")
        return await claim(envelope)

    return claim_or_break


async def test_an_entry_whose_claim_raises_is_dead_lettered_alone(
    settings: Settings,
    database_url: str,
    amqp_server_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger = SteeredLedger()
    registry = steered_registry(ledger)
    broken = record_one(database_url, registry, payment_id="pay_broken")
    neighbours = [record_one(database_url, registry, payment_id=f"pay_{n}") for n in range(3)]
    async with running_consumer(chunked(settings), registry) as consumer:
        monkeypatch.setattr(consumer.claims, "claim", breaking_claims_of(consumer, broken))
        await publish_raw(
            amqp_server_url, settings.exchange, chunk_of(database_url, *neighbours, broken)
        )
        for neighbour in neighbours:
            await eventually(
                in_state(database_url, neighbour, S.COMMITTED), within=20, what="neighbour"
            )
        # Sent round alone, it fails alone until the queue's delivery limit dead-letters
        # it; the chunk itself was acknowledged at once.
        dead = await read_raw(amqp_server_url, settings.dead_letter_queue, expect=1, within=60)
        sent_alone = counter_value(
            consumer, "outbox_consumer_deliveries_total", result="sent_alone"
        )
    assert sent_alone == 1
    assert len(dead) == 1
    envelope = parse_body(dead[0].body)
    assert isinstance(envelope, OperationMessage)
    assert envelope.operation_id == broken
    assert dead[0].message_id == "outbox-1"
    assert sorted(ledger.calls) == sorted(str(op) for op in neighbours)
    assert operation(database_url, broken).state is S.PREPARED
    for neighbour in neighbours:
        names = [e.name for e in events(database_url, neighbour)]
        assert names.count("operation.attempted") == 1
        assert "operation.delivery_suppressed" not in names
    assert await read_raw(amqp_server_url, settings.queue, expect=1, within=1.0) == []
