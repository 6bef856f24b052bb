"""The callbacks inbox (schema version 7): a verified callback is recorded once, by its
provider's event id, through outbox_record_callback; it names its operation by id or by
the provider's reference, moves nothing and enters that operation's chain when the
consumer applies it; one for no operation is kept as unmatched. docs/design.md section
5, "Callbacks"."""

from __future__ import annotations

import hashlib
import uuid
from datetime import datetime
from typing import Any

import psycopg
import pytest

from outbox import Operation, OperationState, Registry
from outbox import store as outbox_store
from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.errors import DatabaseError, IllegalTransition
from outbox.models import CallbackOutcome
from outbox.store import CallbackReceipt, Plan, Store

from support.db_helpers import execute_admin
from support.ops_helpers import Ops

S = OperationState


def run(url: str, plan: Plan[Any]) -> Any:
    with psycopg.connect(url) as connection:
        return Store(connection).run(plan)


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def new_operation(url: str, registry: Registry) -> Operation:
    return Ops(url, registry).new()


def record(
    url: str,
    operation_id: uuid.UUID | None,
    *,
    event_id: str = "evt_1",
    provider: str = "payments",
    status: CallbackStatus = CallbackStatus.COMMITTED,
    reference: str | None = "re_1",
    body: bytes = b'{"id": "evt_1"}',
) -> CallbackReceipt:
    report = CallbackReport(
        event_id=event_id,
        status=status,
        operation_id=operation_id,
        provider_reference=reference,
    )
    receipt: CallbackReceipt = run(
        url, outbox_store.record_callback(provider, report, digest(body))
    )
    return receipt


def inbox(url: str) -> list[tuple[Any, ...]]:
    return execute_admin(
        url,
        "SELECT id, provider, event_id, status, named_operation_id, operation_id, "
        "provider_reference, payload_digest, outcome, applied_at IS NOT NULL "
        "FROM callbacks ORDER BY id",
    )


def apply(url: str, operation_id: uuid.UUID) -> None:
    """What the consumer does once it has applied each of an operation's callbacks:
    record the outcome (evidence, here), which chains the callback's event."""
    with psycopg.connect(url) as connection:
        store = Store(connection)
        for callback in store.run(outbox_store.callbacks_of([operation_id]))[operation_id]:
            if callback.outcome is None:
                store.run(outbox_store.mark_callback(callback, CallbackOutcome.EVIDENCE))


def event_names(url: str, operation_id: uuid.UUID) -> list[str]:
    return [event.name for event in run(url, outbox_store.events(operation_id))]


def test_a_callback_is_recorded_once_as_evidence_and_moves_nothing(
    database_url: str, registry: Registry
) -> None:
    operation = new_operation(database_url, registry)

    receipt = record(database_url, operation.id)

    assert receipt.result == "recorded"
    assert receipt.operation_id == operation.id
    assert receipt.same_payload
    [row] = inbox(database_url)
    assert row == (
        receipt.callback_id,
        "payments",
        "evt_1",
        "committed",
        operation.id,
        operation.id,
        "re_1",
        digest(b'{"id": "evt_1"}'),
        None,
        False,
    )
    # Recorded, it is in the inbox only: the chain takes it when the consumer applies it.
    assert event_names(database_url, operation.id) == ["operation.prepared"]
    assert run(database_url, outbox_store.get_operation(operation.id)).state is S.PREPARED

    apply(database_url, operation.id)

    events = run(database_url, outbox_store.events(operation.id))
    assert events[-1].name == "operation.callback_received"
    received_at = events[-1].attributes.pop("received_at")
    assert events[-1].attributes == {
        "callback": receipt.callback_id,
        "provider": "payments",
        "status": "committed",
        "provider_reference": "re_1",
    }
    [callback] = run(database_url, outbox_store.callbacks_of([operation.id]))[operation.id]
    assert datetime.fromisoformat(received_at) == callback.received_at
    assert run(database_url, outbox_store.get_operation(operation.id)).state is S.PREPARED
    assert run(database_url, outbox_store.verify_chain(operation.id)).intact


def test_a_callback_enters_the_chain_once_when_it_is_applied(
    database_url: str, registry: Registry
) -> None:
    operation = new_operation(database_url, registry)
    record(database_url, operation.id)
    apply(database_url, operation.id)
    names = event_names(database_url, operation.id)

    [callback] = run(database_url, outbox_store.callbacks_of([operation.id]))[operation.id]
    with pytest.raises(IllegalTransition):
        run(database_url, outbox_store.mark_callback(callback, CallbackOutcome.SETTLED))

    assert event_names(database_url, operation.id) == names
    assert names.count("operation.callback_received") == 1


def test_a_redelivered_callback_is_a_duplicate_and_changes_nothing(
    database_url: str, registry: Registry
) -> None:
    operation = new_operation(database_url, registry)
    first = record(database_url, operation.id)
    rows, events = inbox(database_url), event_names(database_url, operation.id)

    again = record(database_url, operation.id)

    assert (again.result, again.callback_id, again.same_payload) == (
        "duplicate",
        first.callback_id,
        True,
    )
    assert inbox(database_url) == rows
    assert event_names(database_url, operation.id) == events


def test_an_event_id_redelivered_with_another_body_says_so_and_changes_nothing(
    database_url: str, registry: Registry
) -> None:
    operation = new_operation(database_url, registry)
    record(database_url, operation.id)
    rows = inbox(database_url)

    other = record(
        database_url, operation.id, status=CallbackStatus.REJECTED, body=b'{"id": "evt_1", "x": 1}'
    )

    assert (other.result, other.same_payload) == ("duplicate", False)
    assert inbox(database_url) == rows


def test_one_event_id_from_two_providers_is_two_callbacks(
    database_url: str, registry: Registry
) -> None:
    operation = new_operation(database_url, registry)

    first = record(database_url, operation.id, provider="payments")
    second = record(database_url, operation.id, provider="email")

    assert (first.result, second.result) == ("recorded", "recorded")
    assert first.callback_id != second.callback_id


def test_an_operation_takes_sixty_four_callbacks_and_the_rest_are_kept_unmatched(
    database_url: str, registry: Registry
) -> None:
    # A signing secret in the wrong hands cannot grow what the consumer reads before
    # each decision on one operation, or what its page lists.
    operation = new_operation(database_url, registry)

    receipts = [
        record(database_url, operation.id, event_id=f"evt_flood_{number}") for number in range(70)
    ]

    assert [r.result for r in receipts] == ["recorded"] * 64 + ["unmatched"] * 6
    kept = run(database_url, outbox_store.callbacks_of([operation.id]))[operation.id]
    assert len(kept) == 64
    listed = run(database_url, outbox_store.list_callbacks(unmatched=True))
    assert {c.named_operation_id for c in listed} == {operation.id}
    assert len(listed) == 6


def test_a_callback_for_no_operation_is_kept_as_unmatched(database_url: str) -> None:
    stranger = uuid.uuid4()

    receipt = record(database_url, stranger, reference="re_nobody")

    assert (receipt.result, receipt.operation_id) == ("unmatched", None)
    [row] = inbox(database_url)
    assert row[4:6] == (stranger, None)
    assert row[8:] == ("unmatched", True)
    listed = run(database_url, outbox_store.list_callbacks(unmatched=True))
    assert [(c.id, c.named_operation_id) for c in listed] == [(receipt.callback_id, stranger)]
    assert execute_admin(database_url, "SELECT count(*) FROM operation_events") == [(0,)]


def test_a_callback_names_its_operation_by_the_providers_reference(
    database_url: str, registry: Registry
) -> None:
    operation = Ops(database_url, registry).at(S.COMMITTED)  # provider reference re_found

    receipt = record(database_url, None, reference="re_found", status=CallbackStatus.REJECTED)

    assert (receipt.result, receipt.operation_id) == ("recorded", operation.id)
    apply(database_url, operation.id)
    assert event_names(database_url, operation.id)[-1] == "operation.callback_received"


def test_an_operations_callbacks_are_read_in_the_order_they_came(
    database_url: str, registry: Registry
) -> None:
    operation = new_operation(database_url, registry)
    for number, status in enumerate((CallbackStatus.PENDING, CallbackStatus.COMMITTED)):
        record(database_url, operation.id, event_id=f"evt_{number}", status=status)

    found = run(database_url, outbox_store.callbacks_of([operation.id]))

    assert [(c.event_id, c.status) for c in found[operation.id]] == [
        ("evt_0", "pending"),
        ("evt_1", "committed"),
    ]


def test_a_callback_waits_for_no_transaction_that_holds_its_operation(
    database_url: str, registry: Registry
) -> None:
    """The lock protocol since version 11: the reconciler decides with the row locked
    (FOR NO KEY UPDATE, as every daemon locks an operation); a callback that comes
    meanwhile is recorded at once, without waiting, and applied after the decision, to
    what it wrote: never lost, never decided around."""
    operation = new_operation(database_url, registry)
    with psycopg.connect(database_url) as holder:
        locked = Store(holder).run(outbox_store.lock_operation(operation.id))
        assert locked is not None
        receipt = record(database_url, operation.id)  # would hang before version 11
        assert receipt.result == "recorded"
        Store(holder).run(
            outbox_store.transition(
                operation.id, source=S.PREPARED, target=S.ESCALATED, error_class="undeliverable"
            )
        )

    apply(database_url, operation.id)

    assert event_names(database_url, operation.id)[-2:] == [
        "operation.escalated",
        "operation.callback_received",
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("event_id", "evt with space"),
        ("event_id", "e" * 256),
        ("event_id", "evt\x1b[2J"),
        ("event_id", ""),
        ("provider", "Payments"),
        ("reference", "r" * 501),
        ("reference", "re_\n1"),
    ],
)
def test_values_outside_the_bounds_are_refused_by_the_database(
    database_url: str, registry: Registry, field: str, value: str
) -> None:
    operation = new_operation(database_url, registry)
    options: dict[str, Any] = {field: value}

    with pytest.raises(DatabaseError) as refused:
        record(database_url, operation.id, **options)

    assert isinstance(refused.value.driver_error, psycopg.errors.CheckViolation)
    assert inbox(database_url) == []
