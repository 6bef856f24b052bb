"""The tools the benchmarks record decisions for.

``noop`` is the provider tool the end-to-end benchmark runs: ``outbox consumer --tools
bench.e2e_tools``.

It does no I/O, so what the benchmark measures is the runtime around the effect:
claim (committed before the call), execute, record ``committed`` under the fencing token,
ack. An idempotent write needs neither a lookup nor a dedupe window, so the contract is
refused nothing and nothing but the runtime's own work sits on the path.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, ConfigDict, Field

from outbox import (
    ApprovalPolicy,
    EffectResult,
    ExecutionContext,
    Registry,
    RetryPolicy,
    SideEffect,
    ToolContract,
)

TOOL = "noop"


class NoopInput(BaseModel):
    n: int = Field(ge=0)


async def noop(_: NoopInput, ctx: ExecutionContext) -> EffectResult:
    """Confirms at once; the reference is derived from the idempotency key, as a real
    provider's would be tied to it."""
    return EffectResult(provider_reference=f"noop_{ctx.idempotency_key[:8]}")


def build_registry() -> Registry:
    registry = Registry()
    registry.register(
        ToolContract(
            name=TOOL,
            version=1,
            input_model=NoopInput,
            side_effect=SideEffect.IDEMPOTENT_WRITE,
            execute=noop,
            retry=RetryPolicy(max_attempts=3, initial_backoff=timedelta(milliseconds=100)),
            deadline=timedelta(seconds=5),
            description="Does nothing and confirms at once: the benchmark's provider.",
        )
    )
    return registry


registry = build_registry()

REFUND_TOOL = "send_refund"


class RefundInput(BaseModel):
    """The input of the test suite's ``send_refund`` (tests/support/sample_tools.py)."""

    model_config = ConfigDict(strict=True)

    payment_id: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(gt=0)
    currency: str = Field(default="EUR", pattern=r"^[A-Z]{3}$")
    reason: str = ""


async def refund_never_run(_: RefundInput, ctx: ExecutionContext) -> EffectResult:
    raise AssertionError("the decision benchmarks record refunds; nothing executes them")


def refund_registry() -> Registry:
    """``send_refund`` as the decision-side benchmarks (bench/dispatcher.py,
    bench/record_decision.py) record it: the test suite's contract in everything a
    decision pays for (input validation, approval rule, dedupe window), no provider.
    Its own copy, so that the benchmarks import nothing from tests/."""
    registry = Registry()
    registry.register(
        ToolContract(
            name=REFUND_TOOL,
            version=1,
            input_model=RefundInput,
            side_effect=SideEffect.DEDUPLICATED_WRITE,
            retry=RetryPolicy(
                max_attempts=5,
                initial_backoff=timedelta(milliseconds=50),
                max_backoff=timedelta(milliseconds=200),
                reconcile_max_attempts=3,
            ),
            execute=refund_never_run,
            approval=ApprovalPolicy.above("amount_cents", 50_000),
            dedupe_window=timedelta(hours=24),
            deadline=timedelta(seconds=2),
            description="Refund part or all of a captured payment to the customer.",
        )
    )
    return registry
