"""The intent is computed once: what prepare_decision records is exactly what
derive_intent recomputes from the stored row, and a row that differs is named by the
first check it fails, never an exception that would take the consumer's burst down."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

import pytest
from pydantic import BaseModel

from outbox.contracts import ApprovalPolicy, Registry, SideEffect, ToolContract
from outbox.intent import TAMPER_CHECKS, derive_intent, prepare_decision
from outbox.models import Operation
from outbox.outcomes import EffectResult, ExecutionContext
from outbox.states import OperationState
from outbox.store import NewDecision

NOW = datetime(2026, 12, 2, tzinfo=UTC)


class RefundInput(BaseModel):
    customer_id: str
    amount_cents: int
    currency: str = "EUR"


async def succeed(tool_input: BaseModel, ctx: ExecutionContext) -> EffectResult:
    return EffectResult()


@pytest.fixture
def registry() -> Registry:
    registry = Registry()
    registry.register(
        ToolContract(
            name="send_refund",
            version=1,
            input_model=RefundInput,
            side_effect=SideEffect.IDEMPOTENT_WRITE,
            execute=succeed,
            approval=ApprovalPolicy.above("amount_cents", 50_000),
        )
    )
    return registry


def stored(decision: NewDecision, **changes: Any) -> Operation:
    """The operation row record_decision would write for ``decision``, with ``changes``."""
    return Operation.model_validate(
        {
            "id": uuid4(),
            "run_id": decision.run_id,
            "decision_key": decision.decision_key,
            "tool_name": decision.tool_name,
            "tool_version": decision.tool_version,
            "side_effect": decision.side_effect,
            "input": decision.input,
            "input_fingerprint": decision.input_fingerprint,
            "requires_approval": decision.requires_approval,
            "state": OperationState.PREPARED,
            "attempts": 0,
            "reconcile_attempts": 0,
            "lease_token": 0,
            "lease_owner": None,
            "lease_expires_at": None,
            "next_attempt_at": NOW,
            "first_attempt_at": None,
            "provider_reference": None,
            "result": None,
            "last_error_class": None,
            "effect_possible": False,
            "created_at": NOW,
            "updated_at": NOW,
            **changes,
        }
    )


@pytest.mark.parametrize(
    "tool_input",
    [
        {"customer_id": "cus_1", "amount_cents": 1_000},
        {"currency": "USD", "amount_cents": 75_000, "customer_id": "cus_2"},
        {"customer_id": "ünïcødé \u2028", "amount_cents": 2**53 - 1},
    ],
)
def test_the_consumer_derives_what_recording_computed(
    registry: Registry, tool_input: dict[str, Any]
) -> None:
    decision = prepare_decision(registry, "send_refund", tool_input, run_id="run_1")

    intent = derive_intent(registry.get("send_refund"), stored(decision))

    assert intent.disagreement is None
    assert intent.requires_approval is decision.requires_approval
    assert intent.tool_input == RefundInput.model_validate(tool_input)


@pytest.mark.parametrize(
    ("changes", "check"),
    [
        ({"input_fingerprint": "0" * 64}, "fingerprint_mismatch"),
        ({"requires_approval": False}, "approval_flag_mismatch"),
        ({"tool_version": 2}, "tool_mismatch"),
        ({"side_effect": SideEffect.READ_ONLY}, "side_effect_mismatch"),
        ({"input": {"customer_id": "cus_1"}}, "input_invalid"),
        # An integer JSON cannot carry exactly: recording refuses it, a row may hold it.
        ({"input": {"customer_id": "cus_1", "amount_cents": 2**60}}, "input_invalid"),
    ],
)
def test_a_row_that_differs_is_named_by_its_first_failed_check(
    registry: Registry, changes: dict[str, Any], check: str
) -> None:
    decision = prepare_decision(
        registry, "send_refund", {"customer_id": "cus_1", "amount_cents": 75_000}, run_id="r"
    )

    intent = derive_intent(registry.get("send_refund"), stored(decision, **changes))

    assert check in TAMPER_CHECKS
    assert intent.disagreement == check
    assert intent.requires_approval


def test_a_field_the_model_drops_is_not_canonical(registry: Registry) -> None:
    decision = prepare_decision(
        registry, "send_refund", {"customer_id": "cus_1", "amount_cents": 10}, run_id="r"
    )
    padded = dataclasses.replace(decision, input={**decision.input, "note": "smuggled"})

    intent = derive_intent(registry.get("send_refund"), stored(padded))

    assert intent.disagreement == "input_not_canonical"
