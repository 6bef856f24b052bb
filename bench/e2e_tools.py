"""The no-op provider tool the end-to-end benchmark runs: ``outbox consumer --tools
bench.e2e_tools``.

It does no I/O, so what the benchmark measures is the runtime around the effect:
claim (committed before the call), execute, record ``committed`` under the fencing token,
ack. An idempotent write needs neither a lookup nor a dedupe window, so the contract is
refused nothing and nothing but the runtime's own work sits on the path.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, Field

from outbox import (
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
