"""Tools the tests register: a refund with a real (in-memory) provider ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from pydantic import BaseModel, Field

from outbox import (
    ApprovalPolicy,
    EffectResult,
    ExecutionContext,
    Found,
    NotFound,
    OnUnknown,
    Registry,
    RetryPolicy,
    SideEffect,
    ToolContract,
)
from outbox.outcomes import Reconciliation


class RefundInput(BaseModel):
    payment_id: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(gt=0)
    currency: str = Field(default="EUR", pattern=r"^[A-Z]{3}$")
    reason: str = ""


class TicketInput(BaseModel):
    title: str
    body: str = ""


@dataclass
class Ledger:
    """A provider's record of effects, keyed by idempotency key."""

    refunds: dict[str, RefundInput] = field(default_factory=dict)

    async def refund(self, refund: RefundInput, ctx: ExecutionContext) -> EffectResult:
        self.refunds.setdefault(ctx.idempotency_key, refund)
        return EffectResult(provider_reference=f"re_{ctx.idempotency_key[:8]}")

    async def find_refund(self, refund: RefundInput, ctx: ExecutionContext) -> Reconciliation:
        if ctx.idempotency_key in self.refunds:
            return Found(provider_reference=f"re_{ctx.idempotency_key[:8]}")
        return NotFound()

    async def open_ticket(self, ticket: TicketInput, ctx: ExecutionContext) -> EffectResult:
        return EffectResult(provider_reference=f"tk_{ctx.idempotency_key[:8]}")


def refund_contract(ledger: Ledger, version: int = 1) -> ToolContract[RefundInput]:
    return ToolContract(
        name="send_refund",
        version=version,
        input_model=RefundInput,
        side_effect=SideEffect.DEDUPLICATED_WRITE,
        retry=RetryPolicy(max_attempts=5),
        execute=ledger.refund,
        reconcile=ledger.find_refund,
        approval=ApprovalPolicy.above("amount_cents", 50_000),
        dedupe_window=timedelta(hours=24),
        description="Refund part or all of a captured payment to the customer.",
    )


def build_registry(ledger: Ledger | None = None) -> Registry:
    ledger = ledger or Ledger()
    registry = Registry()
    registry.register(refund_contract(ledger))
    registry.register(
        ToolContract(
            name="open_ticket",
            version=1,
            input_model=TicketInput,
            side_effect=SideEffect.NON_REPEATABLE_WRITE,
            execute=ledger.open_ticket,
            on_unknown=OnUnknown.ESCALATE,
        )
    )
    return registry
