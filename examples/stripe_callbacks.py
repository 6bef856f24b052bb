"""Stripe's refund webhooks as evidence for a refund tool, received in a Starlette app of
your own (FastAPI is the same; see docs/callbacks.md). Run the consumer with this module's
tools and serve `create_app(...)` with uvicorn; set OUTBOX_CALLBACK_SECRETS=stripe:whsec_...
(the endpoint's signing secret from Stripe's dashboard, two while you roll it)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import httpx
import psycopg
from pydantic import BaseModel, ConfigDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from outbox import (
    CallbackPolicy,
    CallbackProvider,
    CallbackReport,
    EffectResult,
    ExecutionContext,
    Registry,
    Scheme,
    SideEffect,
    ToolContract,
)
from outbox.callbacks import REFUSED_STATUS, CallbackReceiver, record_callback_async
from outbox.errors import CallbackRefused
from outbox.http import http_outcomes, outcome_of_response, response_json

# A Stripe Refund's status, as what the runtime keeps of it.
REFUND_STATUS = {
    "succeeded": "committed",
    "failed": "rejected",
    "canceled": "rejected",
    "pending": "pending",
    "requires_action": "pending",
}


def read_stripe_refund(event: Mapping[str, Any], delivery: str) -> CallbackReport | None:
    """refund.created / refund.updated / refund.failed: the Refund is the event's
    data.object, and its metadata carries the operation id the tool sent. Any other
    event type (Stripe sends what the endpoint subscribes to) is about no refund."""
    if event.get("type") not in ("refund.created", "refund.updated", "refund.failed"):
        return None
    refund = event["data"]["object"]
    return CallbackReport.for_key(
        event["id"],  # Stripe's event id: the same on every redelivery
        REFUND_STATUS[refund["status"]],
        (refund.get("metadata") or {}).get("outbox_operation_id"),
        refund["id"],
    )


STRIPE = CallbackProvider(name="stripe", scheme=Scheme.STRIPE, read=read_stripe_refund)


class RefundInput(BaseModel):
    model_config = ConfigDict(strict=True)

    payment_intent: str
    amount: int


# One TLS context for every call's client: building one loads the CA certificates.
TLS = httpx.create_ssl_context()


async def create_refund(refund: RefundInput, ctx: ExecutionContext) -> EffectResult:
    """POST /v1/refunds, keyed by the operation id, which also rides in the metadata so
    that Stripe's webhooks name the operation."""
    async with (
        http_outcomes(),
        httpx.AsyncClient(base_url="https://api.stripe.com", verify=TLS) as http,
    ):
        response = await http.post(
            "/v1/refunds",
            data={
                "payment_intent": refund.payment_intent,
                "amount": refund.amount,
                "metadata[outbox_operation_id]": ctx.idempotency_key,
            },
            headers={"Idempotency-Key": ctx.idempotency_key},
            timeout=ctx.remaining(),
        )
    outcome_of_response(response)
    return EffectResult(provider_reference=response_json(response)["id"])


registry = Registry()
registry.register(
    ToolContract(
        name="stripe_refund",
        version=1,
        input_model=RefundInput,
        side_effect=SideEffect.DEDUPLICATED_WRITE,
        execute=create_refund,
        dedupe_window=timedelta(hours=24),
        # Stripe's signed refund.updated with status succeeded is the effect, reported
        # by the only party that knows: it may settle an unknown outcome. A failure does
        # not prove this request's refund absent (it may be another attempt's).
        callbacks=CallbackPolicy(STRIPE, settles_unknown=True),
        description="Refund part or all of a Stripe payment, at most once per operation.",
    )
)


def create_app(receiver: CallbackReceiver, database_url: str) -> Starlette:
    """One route for Stripe's endpoint. Connect as a login in outbox_callbacks."""

    async def stripe_webhook(request: Request) -> JSONResponse:
        # Verify before anything else; put a body limit in front (a proxy) as well.
        body = await request.body()
        try:
            async with await psycopg.AsyncConnection.connect(
                database_url, autocommit=True
            ) as connection:
                received = await record_callback_async(
                    connection, receiver, "stripe", body, request.headers
                )
        except CallbackRefused as refused:
            return JSONResponse({"error": refused.reason}, REFUSED_STATUS[refused.reason])
        # recorded, duplicate, unmatched or ignored: all 2xx, or Stripe sends it again.
        return JSONResponse({"result": received.result})

    return Starlette(routes=[Route("/webhooks/stripe", stripe_webhook, methods=["POST"])])
