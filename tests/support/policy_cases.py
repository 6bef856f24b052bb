"""The consumer's decisions, row by row of the per-class retry table (docs/design.md section 5).

| class | retryable-before-send | outcome_unknown |
|---|---|---|
| read_only | retry | retry |
| idempotent_write | retry | retry same input |
| deduplicated_write | retry same key | retry same key only inside the dedupe window |
| non_repeatable_write | retry | reconcile; retry only after not_found; else escalate |

A contract with a lookup is always looked up before anything else, whatever its class.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

from consumer.policy import LEASE_LOST_BEFORE_CALL, Attempt, AttemptOutcome
from outbox.contracts import OnUnknown, RetryPolicy, SideEffect, ToolContract
from outbox.models import Operation
from outbox.outcomes import EffectResult, ExecutionContext, Reconciliation
from outbox.states import OperationState

S = OperationState


NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


DEADLINE = timedelta(seconds=30)


WINDOW = timedelta(hours=1)


# No jitter, so every delay is exact: 1 s, then doubling.
RETRY = RetryPolicy(
    max_attempts=3,
    initial_backoff=timedelta(seconds=1),
    max_backoff=timedelta(minutes=1),
    multiplier=2.0,
    jitter=0.0,
    reconcile_max_attempts=3,
)


EVERY_CLASS = list(SideEffect)


class Refund(BaseModel):
    amount_cents: int


async def never_called(tool_input: Refund, context: ExecutionContext) -> EffectResult:
    raise AssertionError("the policy never calls a tool")


async def never_looked_up(tool_input: Refund, context: ExecutionContext) -> Reconciliation:
    raise AssertionError("the policy never looks anything up")


def contract(
    side_effect: SideEffect,
    *,
    lookup: bool = False,
    on_unknown: OnUnknown = OnUnknown.RECONCILE,
    retry: RetryPolicy = RETRY,
) -> ToolContract[Refund]:
    return ToolContract(
        name="send_refund",
        version=1,
        input_model=Refund,
        side_effect=side_effect,
        execute=never_called,
        retry=retry,
        reconcile=never_looked_up if lookup else None,
        dedupe_window=WINDOW if side_effect is SideEffect.DEDUPLICATED_WRITE else None,
        on_unknown=on_unknown,
        deadline=DEADLINE,
    )


def operation(**changes: Any) -> Operation:
    """An operation in flight on its first attempt, begun a minute ago."""
    fields: dict[str, Any] = {
        "id": uuid.UUID("3f2a4c1e-0d6b-4f7a-9c1e-2b3d4e5f6a7b"),
        "run_id": "run",
        "decision_key": None,
        "tool_name": "send_refund",
        "tool_version": 1,
        "side_effect": SideEffect.NON_REPEATABLE_WRITE,
        "input": {"amount_cents": 1250},
        "input_fingerprint": "ab" * 32,
        "requires_approval": False,
        "state": S.IN_FLIGHT,
        "attempts": 1,
        "reconcile_attempts": 0,
        "lease_token": 7,
        "lease_owner": "host:1:0001",
        "lease_expires_at": NOW + timedelta(seconds=35),
        "next_attempt_at": NOW - timedelta(minutes=1),
        "first_attempt_at": NOW - timedelta(minutes=1),
        "provider_reference": None,
        "result": None,
        "last_error_class": None,
        "effect_possible": False,
        "created_at": NOW - timedelta(minutes=1),
        "updated_at": NOW,
    }
    fields.update(changes)
    return Operation(**fields)


def unknown(**changes: Any) -> Operation:
    """An operation whose first attempt's outcome is unknown, due for attention."""
    return operation(
        state=S.OUTCOME_UNKNOWN,
        last_error_class="response_lost",
        **{"effect_possible": True, **changes},
    )


attempts = st.builds(
    Attempt,
    st.sampled_from(list(AttemptOutcome)),
    st.sampled_from(["connect_refused", LEASE_LOST_BEFORE_CALL, "response_lost"]),
    st.just(EffectResult(provider_reference="re_1")),
)


def at(state: OperationState, **changes: Any) -> Operation:
    settled = {"lease_owner": None, "lease_expires_at": None}
    if state is S.IN_FLIGHT:
        settled = {}
    return operation(state=state, **{**settled, **changes})
