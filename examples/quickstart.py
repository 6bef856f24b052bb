"""Register a tool with its side-effect contract, then record one agent decision in
the caller's own transaction. Run `outbox migrate` first."""

from __future__ import annotations

import os
from datetime import timedelta

import httpx
import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from outbox import (
    DefinitiveRejection,
    EffectResult,
    ExecutionContext,
    NotSent,
    OutcomeUnknown,
    Registry,
    RetryPolicy,
    SideEffect,
    ToolContract,
    record_decision,
)
from outbox.settings import sqlalchemy_url


class RefundInput(BaseModel):
    # Strict: True is not an amount of 1 cent, "1250" is not 1250.
    model_config = ConfigDict(strict=True)

    payment_id: str
    amount_cents: int
    reason: str = ""


# Built once: each client built without one loads the CA certificates again, tens of
# milliseconds of CPU an effect.
TLS = httpx.create_ssl_context()


async def send_refund(refund: RefundInput, ctx: ExecutionContext) -> EffectResult:
    """Runs in the consumer, never here: one operation id = one idempotency key."""
    async with httpx.AsyncClient(
        base_url="https://payments.example", timeout=ctx.remaining(), verify=TLS
    ) as http:
        try:
            response = await http.post(
                "/refunds",
                json=refund.model_dump(),
                headers={"Idempotency-Key": ctx.idempotency_key},
            )
        except httpx.ConnectError:
            raise NotSent("connect_failed") from None  # the request never left
        except httpx.TransportError:
            raise OutcomeUnknown("transport_error") from None  # it may have landed
    if response.status_code == 409 or response.status_code >= 500:
        raise OutcomeUnknown(f"http_{response.status_code}")
    if response.status_code >= 400:
        raise DefinitiveRejection(f"http_{response.status_code}")
    return EffectResult(provider_reference=response.json()["id"])


registry = Registry()
registry.register(
    ToolContract(
        name="send_refund",
        version=1,
        input_model=RefundInput,
        side_effect=SideEffect.DEDUPLICATED_WRITE,
        retry=RetryPolicy(max_attempts=5),
        execute=send_refund,
        dedupe_window=timedelta(hours=24),
    )
)

# sqlalchemy_url: a libpq host list (a primary and its standbys) becomes SQLAlchemy's form.
engine = sa.create_engine(
    sqlalchemy_url(os.environ.get("OUTBOX_DATABASE_URL", "postgresql+psycopg://localhost/outbox"))
)
with engine.begin() as conn:  # the caller's transaction
    conn.execute(sa.text("SELECT 1"))  # ... its own business write goes here
    op = record_decision(
        conn,
        registry,
        "send_refund",
        {"payment_id": "pay_1", "amount_cents": 1250},
        run_id="run_12",
        decision_key="call_abc",
    )
print(f"{op.operation.display_id} {op.operation.state} created={op.created}")
