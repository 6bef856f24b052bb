"""What a provider's callback does to an operation, row by row of the table in
docs/design.md section 5 ("Callbacks"), end to end: the callback is signed and sent over
real HTTP to `outbox callbacks serve` (as a login of outbox_callbacks), then the
consumer's reconciler applies it (as a login of outbox_consumer). And the races: a
callback that lands while an attempt is in flight, while the worker's record is being
written, while a lease runs out, while the reconciler decides."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from pydantic import SecretStr

from consumer.claims import Claimed
from consumer.worker import Consumer
from outbox import Operation, OperationState, Registry, Settings
from outbox import store as outbox_store
from outbox.broker import OperationMessage
from outbox.callback_policy import CallbackPolicy
from outbox.store import Store

from support.callback_helpers import (
    PAYMENTS,
    SECRETS,
    TICKETS,
    Receiving,
    callback_registry,
    event,
    receiving,
    signed,
)
from support.db_helpers import execute_admin
from support.dispatch_helpers import counter_value
from support.logins import Login, group_logins
from support.ops_helpers import Ops
from support.sample_tools import Ledger, refund_contract

S = OperationState
LATER = timedelta(hours=1)


@pytest.fixture
def login(postgres_server_url: str, database_url: str) -> Iterator[Login]:
    with group_logins(postgres_server_url, database_url) as make:
        yield make


@dataclasses.dataclass
class World:
    """The server, the reconciler's consumer, and the database seen as its owner."""

    server: Receiving
    consumer: Consumer
    ops: Ops
    database_url: str
    ledger: Ledger

    def send(self, provider: str, payload: dict[str, Any], **signing: Any) -> str:
        answer = self.server.send(provider, payload, **signing)
        assert answer.status_code == 200, answer.text
        result: str = answer.json()["result"]
        return result

    async def reconcile(self) -> None:
        await self.consumer.reconciler.reconcile_once()

    def outcomes(self, operation_id: uuid.UUID) -> list[str | None]:
        rows = execute_admin(
            self.database_url,
            "SELECT outcome FROM callbacks WHERE operation_id = %s ORDER BY id",
            (operation_id,),
        )
        return [outcome for (outcome,) in rows]

    def events(self, operation_id: uuid.UUID) -> list[tuple[str, dict[str, Any]]]:
        return [(e.name, dict(e.attributes)) for e in self.ops.events(operation_id)]

    def applied(self, tool: str, outcome: str) -> float:
        return counter_value(
            self.consumer, "outbox_callbacks_applied_total", tool=tool, outcome=outcome
        )

    def unknown(self, tool: str = "send_refund", *, due: bool = False) -> Operation:
        """An unknown outcome, as the worker leaves it: attempted, its answer lost, and
        (unless ``due``) not due for the reconciler's attention for an hour."""
        operation = self.ops.at(S.IN_FLIGHT, tool=tool)
        moved: Operation = self.ops.run(
            outbox_store.transition(
                operation.id,
                source=S.IN_FLIGHT,
                target=S.OUTCOME_UNKNOWN,
                lease_token=operation.lease_token,
                error_class="connection_lost",
                delay=None if due else LATER,
            )
        )
        return moved


@contextlib.asynccontextmanager
async def world_for(
    settings: Settings, login: Login, database_url: str, ledger: Ledger, registry: Registry
) -> AsyncIterator[World]:
    consumer = Consumer(
        settings.model_copy(update={"database_url": SecretStr(login("outbox_consumer"))}),
        registry,
    )
    try:
        declared = registry.callback_providers()
        secrets = {name: keys for name, keys in SECRETS.items() if name in declared}
        with receiving(settings, login("outbox_callbacks"), registry, secrets) as server:
            yield World(server, consumer, Ops(database_url, registry), database_url, ledger)
    finally:
        await consumer.close()


@pytest.fixture
async def world(
    settings: Settings, login: Login, database_url: str, ledger: Ledger
) -> AsyncIterator[World]:
    """Both providers' successes settle unknown outcomes; no failure is definitive."""
    async with world_for(settings, login, database_url, ledger, callback_registry(ledger)) as built:
        yield built


@pytest.fixture
async def strict(
    settings: Settings, login: Login, database_url: str, ledger: Ledger
) -> AsyncIterator[World]:
    """Callbacks may settle nothing: every success is evidence for a person."""
    registry = callback_registry(
        ledger, refunds=CallbackPolicy(PAYMENTS), tickets=CallbackPolicy(TICKETS)
    )
    async with world_for(settings, login, database_url, ledger, registry) as built:
        yield built


@pytest.fixture
async def definitive(
    settings: Settings, login: Login, database_url: str, ledger: Ledger
) -> AsyncIterator[World]:
    """The payments provider's failure callbacks are definitive."""
    registry = callback_registry(
        ledger, refunds=CallbackPolicy(PAYMENTS, settles_unknown=True, failure_definitive=True)
    )
    async with world_for(settings, login, database_url, ledger, registry) as built:
        yield built


def envelope(operation: Operation) -> OperationMessage:
    return OperationMessage(
        operation_id=operation.id,
        outbox_id=1,
        tool=operation.tool_name,
        tool_version=operation.tool_version,
        input_fingerprint=operation.input_fingerprint,
    )


async def claimed(world: World, operation: Operation) -> Claimed:
    verdict = await world.consumer.claim(envelope(operation))
    assert isinstance(verdict, Claimed), verdict
    return verdict


# --- committed callback ------------------------------------------------------------------


async def test_a_success_settles_an_unknown_outcome_where_the_contract_allows(
    world: World,
) -> None:
    operation = world.unknown()

    assert world.send("payments", event("effect.committed", operation.id, reference="re_cb")) == (
        "recorded"
    )
    await world.reconcile()

    settled = world.ops.get(operation.id)
    assert (settled.state, settled.provider_reference) == (S.COMMITTED, "re_cb")
    name, attributes = world.events(operation.id)[-1]
    assert name == "operation.reconciled"
    assert attributes == {
        "from": "outcome_unknown",
        "to": "committed",
        "result": "committed",
        "method": "callback",
        "callback": attributes["callback"],
        "provider_reference": "re_cb",
    }
    assert world.outcomes(operation.id) == ["settled"]
    assert world.applied("send_refund", "settled") == 1
    assert world.ops.run(outbox_store.verify_chain(operation.id)).intact


async def test_an_unknown_email_is_settled_by_its_callback_instead_of_a_person(
    world: World,
) -> None:
    # open_ticket escalates every unknown outcome by contract, once its wait for a
    # callback is over; the callback comes first.
    operation = world.unknown("open_ticket")

    world.send("tickets", event("effect.committed", operation.id, reference="tk_1"))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.COMMITTED
    assert "operation.escalated" not in world.ops.event_names(operation.id)


async def test_a_success_is_evidence_where_the_contract_does_not_let_it_settle(
    strict: World,
) -> None:
    operation = strict.unknown()

    strict.send("payments", event("effect.committed", operation.id, reference="re_cb"))
    await strict.reconcile()

    assert strict.ops.get(operation.id).state is S.OUTCOME_UNKNOWN
    assert strict.outcomes(operation.id) == ["evidence"]
    assert strict.ops.event_names(operation.id)[-1] == "operation.callback_received"


async def test_a_lookups_not_found_after_a_reported_success_goes_to_a_person_not_a_retry(
    strict: World,
) -> None:
    # The provider's lookup says "no such refund" (eventual consistency), its callback
    # said "done": a retry would be a second refund.
    operation = strict.unknown(due=False)
    strict.send("payments", event("effect.committed", operation.id, reference="re_cb"))
    await strict.reconcile()
    execute_admin(
        strict.database_url,
        "UPDATE operations SET next_attempt_at = now() WHERE id = %s",
        (operation.id,),
    )

    await strict.reconcile()

    final = strict.ops.get(operation.id)
    assert final.state is S.ESCALATED
    names = strict.ops.event_names(operation.id)
    assert names[-2:] == ["operation.contradicted", "operation.escalated"]
    assert strict.events(operation.id)[-1][1]["reason"] == "contradicted"
    assert strict.events(operation.id)[-2][1]["reason"] == "not_found_and_success"
    assert strict.ledger.calls == []  # never attempted again
    assert (
        counter_value(strict.consumer, "outbox_callbacks_contradicted_total", tool="send_refund")
        == 1
    )


async def test_a_success_for_a_committed_operation_with_its_reference_confirms_it(
    world: World,
) -> None:
    operation = world.ops.at(S.COMMITTED)  # provider reference re_found

    world.send("payments", event("effect.committed", operation.id, reference="re_found"))
    await world.reconcile()

    assert world.outcomes(operation.id) == ["confirmed"]
    assert world.ops.get(operation.id).state is S.COMMITTED


async def test_a_success_with_another_reference_contradicts_a_committed_operation(
    world: World,
) -> None:
    operation = world.ops.at(S.COMMITTED)

    world.send("payments", event("effect.committed", operation.id, reference="re_other"))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.COMMITTED  # terminal stays terminal
    name, attributes = world.events(operation.id)[-1]
    assert name == "operation.contradicted"
    assert attributes["reason"] == "reference_differs"
    assert attributes["provider_reference"] == "re_other"
    assert world.outcomes(operation.id) == ["contradicted"]
    assert (
        counter_value(world.consumer, "outbox_callbacks_contradicted_total", tool="send_refund")
        == 1
    )


async def test_a_success_for_a_prepared_operation_is_escalated_never_retried(
    world: World,
) -> None:
    # A lookup said "not found" and sent it back for another attempt; the provider then
    # reports the first one done.
    operation = world.ops.at(S.PREPARED)

    world.send("payments", event("effect.committed", operation.id, reference="re_cb"))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.ESCALATED
    assert world.ops.event_names(operation.id)[-2:] == [
        "operation.contradicted",
        "operation.escalated",
    ]
    assert world.events(operation.id)[-1][1]["reason"] == "contradicted"
    assert (
        counter_value(
            world.consumer, "outbox_escalations_total", tool="send_refund", reason="contradicted"
        )
        == 1
    )


async def test_a_success_for_a_blind_retry_its_class_allows_is_evidence(
    settings: Settings, login: Login, database_url: str, ledger: Ledger
) -> None:
    # A deduplicated write with no lookup: after its unknown outcome the reconciler sends
    # it back to replay the same key; the provider's success for the first request then
    # says what the replay will find, and is no contradiction.
    blind = dataclasses.replace(
        refund_contract(ledger), reconcile=None, callbacks=CallbackPolicy(PAYMENTS, True)
    )
    registry = Registry()
    registry.register(blind)
    async with world_for(settings, login, database_url, ledger, registry) as world:
        operation = world.unknown(due=True)
        await world.reconcile()
        assert world.ops.get(operation.id).state is S.PREPARED

        world.send("payments", event("effect.committed", operation.id))
        await world.reconcile()

        assert world.ops.get(operation.id).state is S.PREPARED
        assert world.outcomes(operation.id) == ["evidence"]
        assert "operation.contradicted" not in world.ops.event_names(operation.id)


async def test_a_success_for_a_rejected_operation_is_a_contradiction_and_stays_rejected(
    world: World,
) -> None:
    operation = world.ops.at(S.REJECTED)

    world.send("payments", event("effect.committed", operation.id, reference="re_cb"))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.REJECTED
    assert world.events(operation.id)[-1][0] == "operation.contradicted"
    assert world.events(operation.id)[-1][1]["reason"] == "success_for_rejected"
    assert world.outcomes(operation.id) == ["contradicted"]


# --- rejected callback -------------------------------------------------------------------


async def test_a_definitive_failure_sends_an_unknown_outcome_back_for_another_attempt(
    definitive: World,
) -> None:
    operation = definitive.unknown()

    definitive.send("payments", event("effect.rejected", operation.id))
    await definitive.reconcile()

    again = definitive.ops.get(operation.id)
    assert (again.state, again.effect_possible) == (S.PREPARED, False)
    name, attributes = definitive.events(operation.id)[-1]
    assert (name, attributes["result"], attributes["method"]) == (
        "operation.reconciled",
        "not_found",
        "callback",
    )
    rows = definitive.ops.run(outbox_store.outbox_rows(operation.id))
    assert len(rows) == 2  # queued again, like a lookup's NotFound
    assert definitive.outcomes(operation.id) == ["retry"]


async def test_a_definitive_failure_after_a_reported_success_goes_to_a_person(
    definitive: World,
) -> None:
    operation = definitive.unknown()
    definitive.send("payments", event("effect.pending", operation.id))
    definitive.send("payments", event("effect.committed", operation.id))
    # The same pass sees both: the success settles first, then the failure contradicts.
    definitive.send("payments", event("effect.rejected", operation.id))

    await definitive.reconcile()

    assert definitive.ops.get(operation.id).state is S.COMMITTED
    assert definitive.outcomes(operation.id) == ["evidence", "settled", "contradicted"]


async def test_a_failure_against_a_success_on_record_escalates_an_unknown_outcome(
    settings: Settings, login: Login, database_url: str, ledger: Ledger
) -> None:
    # Success callbacks that may not settle, failures that are definitive: the two
    # disagree, and neither may win on its own.
    registry = callback_registry(ledger, refunds=CallbackPolicy(PAYMENTS, failure_definitive=True))
    async with world_for(settings, login, database_url, ledger, registry) as world:
        operation = world.unknown()
        world.send("payments", event("effect.committed", operation.id))
        world.send("payments", event("effect.rejected", operation.id))

        await world.reconcile()

        assert world.ops.get(operation.id).state is S.ESCALATED
        assert world.outcomes(operation.id) == ["evidence", "contradicted"]
        assert world.events(operation.id)[-2][1]["reason"] == "failure_and_success"


async def test_a_failure_that_is_not_definitive_is_evidence(world: World) -> None:
    operation = world.unknown()

    world.send("payments", event("effect.rejected", operation.id))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.OUTCOME_UNKNOWN
    assert world.outcomes(operation.id) == ["evidence"]


async def test_a_failure_after_success_contradicts_a_committed_operation(world: World) -> None:
    operation = world.ops.at(S.COMMITTED)

    world.send("payments", event("effect.rejected", operation.id, reference="re_found"))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.COMMITTED
    assert world.events(operation.id)[-1][1]["reason"] == "failure_after_success"
    assert world.outcomes(operation.id) == ["contradicted"]


async def test_a_failure_confirms_a_rejected_operation(world: World) -> None:
    operation = world.ops.at(S.REJECTED)

    world.send("payments", event("effect.rejected", operation.id))
    await world.reconcile()

    assert world.outcomes(operation.id) == ["confirmed"]


async def test_a_failure_for_a_prepared_operation_is_evidence(definitive: World) -> None:
    operation = definitive.ops.at(S.PREPARED)

    definitive.send("payments", event("effect.rejected", operation.id))
    await definitive.reconcile()

    assert definitive.ops.get(operation.id).state is S.PREPARED
    assert definitive.outcomes(operation.id) == ["evidence"]


# --- pending, escalated, unmatched, another provider, out of order ----------------------


@pytest.mark.parametrize("state", [S.PREPARED, S.COMMITTED, S.REJECTED, S.ESCALATED])
async def test_a_pending_callback_is_evidence(world: World, state: OperationState) -> None:
    operation = world.ops.at(state)

    world.send("payments", event("effect.pending", operation.id))
    await world.reconcile()

    assert world.ops.get(operation.id).state is state
    assert world.outcomes(operation.id) == ["evidence"]


@pytest.mark.parametrize("kind", ["effect.committed", "effect.rejected"])
async def test_a_callback_for_an_escalated_operation_is_evidence_for_its_person(
    world: World, kind: str
) -> None:
    operation = world.ops.at(S.ESCALATED)

    world.send("payments", event(kind, operation.id))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.ESCALATED
    assert world.outcomes(operation.id) == ["evidence"]
    assert world.ops.event_names(operation.id)[-1] == "operation.callback_received"


async def test_a_callback_for_no_operation_is_kept_and_never_applied(world: World) -> None:
    assert world.send("payments", event("effect.committed", uuid.uuid4())) == "unmatched"
    await world.reconcile()

    listed = world.ops.run(outbox_store.list_callbacks(unmatched=True))
    assert [callback.outcome for callback in listed] == ["unmatched"]


async def test_another_providers_callback_neither_settles_nor_contradicts(world: World) -> None:
    refund = world.unknown()
    rejected = world.ops.at(S.REJECTED)

    world.send("tickets", event("effect.committed", refund.id))
    world.send("tickets", event("effect.committed", rejected.id))
    await world.reconcile()

    assert world.ops.get(refund.id).state is S.OUTCOME_UNKNOWN
    assert world.outcomes(refund.id) == ["evidence"]
    assert world.outcomes(rejected.id) == ["evidence"]


async def test_callbacks_out_of_order_never_move_an_operation_backwards(world: World) -> None:
    operation = world.unknown()
    # The provider's "succeeded" overtakes its own "pending".
    world.send("payments", event("effect.committed", operation.id, reference="re_1"))
    await world.reconcile()
    world.send("payments", event("effect.pending", operation.id, reference="re_1"))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.COMMITTED
    assert world.outcomes(operation.id) == ["settled", "evidence"]


# --- in flight: kept, and applied after the worker's fenced record or the reconciler ----


async def test_a_callback_waits_while_its_operation_is_in_flight(world: World) -> None:
    operation = world.ops.new()
    await claimed(world, operation)

    world.send("payments", event("effect.committed", operation.id))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.IN_FLIGHT
    assert world.outcomes(operation.id) == [None]


async def test_a_callback_during_the_call_confirms_what_the_worker_records(
    world: World,
) -> None:
    operation = world.ops.new()
    claim = await claimed(world, operation)
    # The provider's webhook beats its own answer to the worker.
    reference = f"re_{str(operation.id)[:8]}"
    world.send("payments", event("effect.committed", operation.id, reference=reference))

    await world.consumer.record(claim, await world.consumer.attempt(claim))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.COMMITTED
    assert world.outcomes(operation.id) == ["confirmed"]
    # Chained when applied: after the worker's record, which it confirms.
    assert world.ops.event_names(operation.id)[-2:] == [
        "operation.committed",
        "operation.callback_received",
    ]


async def test_a_callback_during_a_call_whose_answer_is_lost_settles_it(world: World) -> None:
    world.ledger.faults.append("drop_response")
    operation = world.ops.new()
    claim = await claimed(world, operation)
    world.send("payments", event("effect.committed", operation.id, reference="re_cb"))

    await world.consumer.record(claim, await world.consumer.attempt(claim))
    await world.reconcile()

    settled = world.ops.get(operation.id)
    assert (settled.state, settled.provider_reference) == (S.COMMITTED, "re_cb")
    assert world.ops.event_names(operation.id)[-3:] == [
        "operation.outcome_unknown",
        "operation.callback_received",
        "operation.reconciled",
    ]
    assert world.events(operation.id)[-1][1]["method"] == "callback"
    assert world.ledger.calls == [str(operation.id)]


async def test_a_callback_for_a_worker_that_died_is_applied_once_its_lease_expires(
    world: World,
) -> None:
    operation = world.ops.new()
    await claimed(world, operation)  # ... and the worker dies before it records anything
    world.send("payments", event("effect.committed", operation.id, reference="re_cb"))
    execute_admin(
        world.database_url,
        "UPDATE operations SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (operation.id,),
    )

    await world.reconcile()

    assert world.ops.get(operation.id).state is S.COMMITTED
    names = world.ops.event_names(operation.id)
    assert names[-3:] == [
        "operation.outcome_unknown",
        "operation.callback_received",
        "operation.reconciled",
    ]
    assert world.events(operation.id)[-3][1]["reason"] == "lease_expired"
    assert world.events(operation.id)[-1][1]["method"] == "callback"


async def test_a_callback_being_recorded_is_never_decided_around(
    world: World, login: Login
) -> None:
    """The race at the end of a wait: open_ticket's unknown outcome is due, its contract
    escalates it; its callback is being recorded at that moment. The reconciler passes
    over the row while the callback's transaction holds it, then settles it."""
    operation = world.unknown("open_ticket", due=True)
    body, headers = signed("tickets", event("effect.committed", operation.id))
    report = world.server.service.receiver.read("tickets", body, headers)
    assert report is not None
    with psycopg.connect(login("outbox_callbacks")) as recording:
        Store(recording).run(outbox_store.record_callback("tickets", report, "e" * 64))
        await world.reconcile()  # the callback's transaction is still open
        assert world.ops.get(operation.id).state is S.OUTCOME_UNKNOWN
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.COMMITTED
    assert "operation.escalated" not in world.ops.event_names(operation.id)


@pytest.mark.parametrize(("due_for", "decided"), [(0, False), (30, True)])
async def test_a_callback_lock_held_by_any_login_holds_the_reconciler_back_ten_seconds_at_most(
    world: World, login: Login, due_for: int, decided: bool
) -> None:
    """Any login may take an advisory lock, the callback lock's key included (an agent
    login, here, for as long as its session lives): the reconciler passes over the
    operation only while it has been due under 10 s, then decides without it."""
    operation = world.unknown("open_ticket", due=True)
    execute_admin(
        world.database_url,
        "UPDATE operations SET next_attempt_at = now() - %s * interval '1 second' WHERE id = %s",
        (due_for, operation.id),
    )
    with psycopg.connect(login("outbox_agent"), autocommit=True) as agent:
        agent.execute("SELECT pg_advisory_lock(outbox_callback_lock_key(%s))", (operation.id,))
        await world.reconcile()

        state = world.ops.get(operation.id).state
    assert (state is not S.OUTCOME_UNKNOWN) is decided
    if decided:
        assert state is S.ESCALATED  # open_ticket's contract: no lookup, to a person


async def test_an_unknown_outcome_past_its_wait_escalates_and_a_late_callback_is_evidence(
    world: World,
) -> None:
    operation = world.unknown("open_ticket", due=True)
    await world.reconcile()
    assert world.ops.get(operation.id).state is S.ESCALATED

    world.send("tickets", event("effect.committed", operation.id))
    await world.reconcile()

    assert world.ops.get(operation.id).state is S.ESCALATED
    assert world.outcomes(operation.id) == ["evidence"]


async def test_every_chain_with_callbacks_in_it_verifies(world: World) -> None:
    operations = [world.unknown(), world.ops.at(S.COMMITTED), world.ops.at(S.PREPARED)]
    for operation in operations:
        world.send("payments", event("effect.committed", operation.id, reference="re_z"))
    await world.reconcile()

    report = world.ops.run(outbox_store.verify_chain(None))
    assert report.intact
    assert report.operations_checked == 3


async def test_every_applied_outcome_is_exported_at_0_from_the_start(world: World) -> None:
    exported = {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in world.consumer.metrics.registry.collect()
        for sample in family.samples
    }
    for tool in ("send_refund", "open_ticket"):
        for outcome in ("settled", "retry", "confirmed", "evidence", "contradicted"):
            labels = (("outcome", outcome), ("tool", tool))
            assert ("outbox_callbacks_applied_total", labels) in exported
        assert ("outbox_callbacks_contradicted_total", (("tool", tool),)) in exported
