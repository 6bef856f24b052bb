"""What each unended operation waits for (outbox.operator.waits) and what a person
checks at the provider (outbox.contract_card.provider_check), from the contract's
fields: the console's operation page shows both."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox.callback_policy import CallbackPolicy
from outbox.contract_card import provider_check
from outbox.contracts import OnUnknown, SideEffect, ToolContract
from outbox.models import ApprovalCheck, ApprovalStatus, Operation
from outbox.operator.waits import operation_wait, prepared_wait
from outbox.states import OperationState
from outbox.store import PreparedWait

from support.callback_helpers import TICKETS
from support.sample_tools import Ledger, refund_contract, ticket_contract

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
S = OperationState


def operation(state: OperationState, **changes: Any) -> Operation:
    values: dict[str, Any] = {
        "id": uuid.uuid4(),
        "run_id": "run",
        "decision_key": None,
        "tool_name": "open_ticket",
        "tool_version": 1,
        "side_effect": SideEffect.NON_REPEATABLE_WRITE,
        "input": {"title": "t"},
        "input_fingerprint": "f" * 64,
        "requires_approval": False,
        "state": state,
        "attempts": 1,
        "reconcile_attempts": 0,
        "lease_token": 1,
        "lease_owner": None,
        "lease_expires_at": None,
        "next_attempt_at": NOW + timedelta(minutes=7),
        "first_attempt_at": NOW - timedelta(minutes=1),
        "provider_reference": None,
        "result": None,
        "last_error_class": None,
        "effect_possible": False,
        "created_at": NOW - timedelta(minutes=2),
        "updated_at": NOW - timedelta(minutes=1),
    }
    return Operation.model_validate({**values, **changes})


def wait_of(op: Operation, contract: ToolContract[Any] | None, **given: Any) -> Any:
    return operation_wait(
        op,
        approval=given.get("approval"),
        unpublished=given.get("unpublished", False),
        contract=contract,
        now=NOW,
    )


def test_a_callback_wait_ends_in_what_the_contract_does_next() -> None:
    waiting = ticket_contract(
        Ledger(), callbacks=CallbackPolicy(TICKETS, wait=timedelta(minutes=10))
    )
    retried = ToolContract(
        name="open_ticket",
        version=1,
        input_model=waiting.input_model,
        side_effect=SideEffect.IDEMPOTENT_WRITE,
        execute=waiting.execute,
        callbacks=CallbackPolicy(TICKETS, wait=timedelta(minutes=10)),
    )
    op = operation(S.OUTCOME_UNKNOWN)

    escalating, retrying = wait_of(op, waiting), wait_of(op, retried)

    assert (escalating.kind, escalating.until) == ("callback", op.next_attempt_at)
    assert escalating.what == "a verified callback from tickets; when none has come, a person"
    assert retrying.what.endswith("when none has come, another attempt, within the retry budget")


def test_an_unknown_outcome_with_a_lookup_counts_its_lookups() -> None:
    op = operation(S.OUTCOME_UNKNOWN, tool_name="send_refund", reconcile_attempts=2)

    wait = wait_of(op, refund_contract(Ledger()))

    assert wait.what == "its next lookup at the provider (lookup 3 of 3; then a person)"
    assert wait.until == op.next_attempt_at


def test_a_lookup_under_way_and_a_provider_that_is_down_come_first() -> None:
    leased = operation(S.OUTCOME_UNKNOWN, lease_expires_at=NOW + timedelta(seconds=30))
    down = operation(S.OUTCOME_UNKNOWN, waiting_since=NOW - timedelta(minutes=3))

    assert wait_of(leased, None).kind == "lookup"
    assert wait_of(leased, None).until == NOW + timedelta(seconds=30)
    assert wait_of(down, None).kind == "provider"


def test_without_the_tools_modules_it_says_what_the_reconciler_may_do() -> None:
    wait = wait_of(operation(S.OUTCOME_UNKNOWN), None)

    assert wait.kind == "reconciler"
    assert "a console started with --tools says which" in wait.what


def test_an_in_flight_lease_that_expired_is_the_reconciler_s() -> None:
    held = operation(S.IN_FLIGHT, lease_expires_at=NOW + timedelta(seconds=5))
    expired = operation(S.IN_FLIGHT, lease_expires_at=NOW - timedelta(seconds=5))

    assert wait_of(held, None).kind == "attempt"
    assert wait_of(expired, None).kind == "lease_expired"


@pytest.mark.parametrize(
    ("changes", "approval", "unpublished", "kind"),
    [
        ({"requires_approval": True}, ApprovalStatus.EXPIRED, False, PreparedWait.APPROVAL),
        ({"requires_approval": True}, ApprovalStatus.VALID, False, PreparedWait.READY),
        ({"waiting_since": NOW}, None, True, PreparedWait.PROVIDER),
        ({}, None, True, PreparedWait.UNPUBLISHED),
        ({"next_attempt_at": NOW + timedelta(seconds=1)}, None, False, PreparedWait.SCHEDULED),
        ({"next_attempt_at": NOW}, None, False, PreparedWait.READY),
    ],
)
def test_a_prepared_operation_waits_for_the_first_that_applies(
    changes: dict[str, Any],
    approval: ApprovalStatus | None,
    unpublished: bool,
    kind: PreparedWait,
) -> None:
    op = operation(S.PREPARED, **{"next_attempt_at": NOW - timedelta(seconds=1), **changes})
    check = None if approval is None else ApprovalCheck(status=approval, reason="r")

    assert prepared_wait(op, check, unpublished=unpublished, now=NOW) is kind


def test_ended_and_escalated_operations_wait_for_nothing_here() -> None:
    for state in (S.COMMITTED, S.REJECTED, S.ESCALATED):
        assert wait_of(operation(state), None) is None


def test_what_to_check_at_the_provider_follows_the_contract() -> None:
    refund = provider_check(refund_contract(Ledger()))
    ticket = provider_check(
        ticket_contract(Ledger(), callbacks=CallbackPolicy(TICKETS, wait=timedelta(minutes=1)))
    )

    assert "it keeps keys 24h, so past that search for the intent above instead" in refund
    assert "The reconciler's lookups asked the same" in refund
    assert "where it takes no key, for the intent above made after the first attempt" in ticket
    assert "Verified callbacks from tickets are listed below" in ticket
    assert "lookups" not in ticket
    assert ticket_contract(Ledger()).on_unknown is OnUnknown.ESCALATE
