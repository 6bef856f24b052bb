"""Tools the tests register: a refund with a real (in-memory) provider ledger."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from outbox import (
    ApprovalPolicy,
    DefinitiveRejection,
    EffectResult,
    ExecutionContext,
    Found,
    NotFound,
    NotSent,
    OnUnknown,
    OutcomeUnknown,
    Registry,
    RetryPolicy,
    SideEffect,
    StillUnknown,
    ToolContract,
)
from outbox.outcomes import Reconciliation


class RefundInput(BaseModel):
    model_config = ConfigDict(strict=True)

    payment_id: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(gt=0)
    currency: str = Field(default="EUR", pattern=r"^[A-Z]{3}$")
    reason: str = ""


class TicketInput(BaseModel):
    model_config = ConfigDict(strict=True)

    title: str
    body: str = ""


@dataclass
class Ledger:
    """A provider's record of effects, keyed by idempotency key, with faults to inject.

    ``faults`` is consumed one per call of an effect, in order: ``"drop_response"``
    commits and then loses the answer, ``"not_sent"`` fails before anything is sent (the
    provider refused the connection: it waits for the provider, spending no attempt),
    ``"not_sent_here"`` fails before anything left this process (an attempt spent),
    ``"reject"`` refuses for good, ``"hang"`` commits and never answers (the deadline
    cuts it). ``calls`` keeps every idempotency key an effect was attempted with.
    """

    refunds: dict[str, RefundInput] = field(default_factory=dict)
    tickets: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    lookups_unavailable: bool = False

    def _fault(self) -> str | None:
        return self.faults.pop(0) if self.faults else None

    async def refund(self, refund: RefundInput, ctx: ExecutionContext) -> EffectResult:
        self.calls.append(ctx.idempotency_key)
        fault = self._fault()
        if fault == "not_sent":
            raise NotSent("connect_failed")
        if fault == "not_sent_here":
            # Never left this process, and says nothing of the provider (no connection
            # was free): the attempt is spent like any other.
            raise NotSent("pool_timeout")
        if fault == "reject":
            raise DefinitiveRejection("amount_exceeds_payment")
        self.refunds.setdefault(ctx.idempotency_key, refund)
        if fault == "drop_response":
            raise OutcomeUnknown("connection_lost")
        if fault == "hang":
            await asyncio.Event().wait()
        return EffectResult(provider_reference=f"re_{ctx.idempotency_key[:8]}")

    async def find_refund(self, refund: RefundInput, ctx: ExecutionContext) -> Reconciliation:
        if self.lookups_unavailable:
            return StillUnknown("lookups_unavailable")
        if ctx.idempotency_key in self.refunds:
            return Found(provider_reference=f"re_{ctx.idempotency_key[:8]}")
        return NotFound()

    async def open_ticket(self, ticket: TicketInput, ctx: ExecutionContext) -> EffectResult:
        self.calls.append(ctx.idempotency_key)
        self.tickets.append(ctx.idempotency_key)
        if self._fault() == "drop_response":
            raise OutcomeUnknown("connection_lost")
        return EffectResult(provider_reference=f"tk_{ctx.idempotency_key[:8]}")


def refund_contract(ledger: Ledger, version: int = 1) -> ToolContract[RefundInput]:
    return ToolContract(
        name="send_refund",
        version=version,
        input_model=RefundInput,
        side_effect=SideEffect.DEDUPLICATED_WRITE,
        retry=RetryPolicy(
            max_attempts=5,
            initial_backoff=timedelta(milliseconds=50),
            max_backoff=timedelta(milliseconds=200),
            reconcile_max_attempts=3,
        ),
        execute=ledger.refund,
        reconcile=ledger.find_refund,
        approval=ApprovalPolicy.above("amount_cents", 50_000),
        dedupe_window=timedelta(hours=24),
        deadline=timedelta(seconds=2),
        description="Refund part or all of a captured payment to the customer.",
    )


def ticket_contract(ledger: Ledger, **options: Any) -> ToolContract[TicketInput]:
    return ToolContract(
        name="open_ticket",
        version=1,
        input_model=TicketInput,
        side_effect=SideEffect.NON_REPEATABLE_WRITE,
        execute=ledger.open_ticket,
        on_unknown=OnUnknown.ESCALATE,
        **options,
    )


def build_registry(ledger: Ledger | None = None) -> Registry:
    ledger = ledger or Ledger()
    registry = Registry()
    registry.register(refund_contract(ledger))
    registry.register(ticket_contract(ledger))
    return registry
