"""Provider callbacks under test: two providers (one signing as Stripe does, one with
Standard Webhooks), a registry whose tools declare them, signed requests, and the
`outbox callbacks serve` application on a real socket."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
from pydantic import SecretStr

from outbox import Registry, Settings
from outbox.callback_policy import (
    CallbackPolicy,
    CallbackProvider,
    CallbackReport,
    CallbackStatus,
    Scheme,
)
from outbox.callbacks import CallbackReceiver
from outbox.callbacks.server import CallbackService, create_app, refused_at_the_door
from outbox.callbacks.verify import sign_standard_webhooks, sign_stripe
from outbox.serving import Limits
from outbox.serving.server import AppServer

from support.sample_tools import Ledger, refund_contract, ticket_contract

PAYMENTS_SECRET = "whsec_payments_secret_0123456789"
PAYMENTS_ROTATED = "whsec_payments_rotated_98765432"
TICKETS_SECRET = "whsec_" + base64.b64encode(b"tickets-secret-of-32-bytes-long!").decode()
FOREIGN_SECRET = "whsec_" + base64.b64encode(b"not-the-providers-secret-at-all!").decode()
SECRETS: dict[str, tuple[str, ...]] = {
    "payments": (PAYMENTS_SECRET,),
    "tickets": (TICKETS_SECRET,),
}
_STATUSES = {
    "effect.committed": CallbackStatus.COMMITTED,
    "effect.rejected": CallbackStatus.REJECTED,
    "effect.pending": CallbackStatus.PENDING,
}


def _report(payload: Mapping[str, Any], event_id: str) -> CallbackReport | None:
    status = _STATUSES.get(str(payload["type"]))
    if status is None:
        return None  # an event about no effect (a ping, an account update)
    return CallbackReport.for_key(
        event_id, status, payload.get("operation"), payload.get("reference")
    )


def read_payments(payload: Mapping[str, Any], delivery: str) -> CallbackReport | None:
    # Stripe style: the event id is in the body.
    return _report(payload, str(payload["id"]))


def read_tickets(payload: Mapping[str, Any], delivery: str) -> CallbackReport | None:
    # Standard Webhooks style: the message id (webhook-id) is the event's identity.
    return _report(payload, delivery)


PAYMENTS = CallbackProvider(name="payments", scheme=Scheme.STRIPE, read=read_payments)
TICKETS = CallbackProvider(name="tickets", scheme=Scheme.STANDARD_WEBHOOKS, read=read_tickets)


def callback_registry(
    ledger: Ledger,
    *,
    refunds: CallbackPolicy | None = None,
    tickets: CallbackPolicy | None = None,
) -> Registry:
    """send_refund (a deduplicated write with a lookup) and open_ticket (non-repeatable,
    every unknown outcome to a person), each with the callback policy given; by default
    both let their provider's success settle an unknown outcome."""
    registry = Registry()
    registry.register(
        dataclasses.replace(
            refund_contract(ledger), callbacks=refunds or CallbackPolicy(PAYMENTS, True)
        )
    )
    registry.register(
        ticket_contract(
            ledger, callbacks=tickets or CallbackPolicy(TICKETS, True, wait=timedelta(seconds=30))
        )
    )
    return registry


def event(
    kind: str,
    operation_id: uuid.UUID | str | None,
    *,
    reference: str | None = None,
    event_id: str | None = None,
    **more: Any,
) -> dict[str, Any]:
    payload: dict[str, Any] = {"id": event_id or f"evt_{uuid.uuid4().hex[:12]}", "type": kind}
    if operation_id is not None:
        payload["operation"] = str(operation_id)
    if reference is not None:
        payload["reference"] = reference
    return {**payload, **more}


def signed(
    provider: str,
    payload: dict[str, Any] | bytes,
    *,
    secrets: tuple[str, ...] | None = None,
    timestamp: float | None = None,
    delivery: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The body and headers a provider sends: Stripe-signed for payments, Standard
    Webhooks for tickets."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    when = time.time() if timestamp is None else timestamp
    if provider == "payments":
        headers = sign_stripe(secrets or (PAYMENTS_SECRET,), body, when)
    else:
        msg = delivery or f"msg_{uuid.uuid4().hex[:12]}"
        headers = sign_standard_webhooks(secrets or (TICKETS_SECRET,), msg, body, when)
    return body, {**headers, "content-type": "application/json"}


@dataclass
class Receiving:
    url: str
    service: CallbackService

    def post(self, provider: str, body: bytes, headers: Mapping[str, str]) -> httpx.Response:
        return httpx.post(
            f"{self.url}/callbacks/{provider}", content=body, headers=dict(headers), timeout=20
        )

    def send(self, provider: str, payload: dict[str, Any], **signing: Any) -> httpx.Response:
        body, headers = signed(provider, payload, **signing)
        return self.post(provider, body, headers)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=20).text


@contextlib.contextmanager
def receiving(
    settings: Settings,
    database_url: str,
    registry: Registry,
    secrets: Mapping[str, tuple[str, ...]] = SECRETS,
    *,
    max_body: int = 64 * 1024,
    tolerance: float = 300.0,
    limits: Limits | None = None,
) -> Iterator[Receiving]:
    """`outbox callbacks serve`'s application on 127.0.0.1 (a free port), connected to
    ``database_url`` (a login of the outbox_callbacks role, in the tests that prove the
    grants), until the block ends."""
    receiver = CallbackReceiver(registry, secrets, tolerance=tolerance, max_body=max_body)
    service = CallbackService.create(
        receiver, settings.model_copy(update={"database_url": SecretStr(database_url)})
    )
    with AppServer(
        create_app(service),
        "127.0.0.1",
        0,
        name="outbox-callbacks-test",
        limits=limits or Limits.from_settings(settings, max_body=max_body),
        lifespan="on",
        refused=refused_at_the_door(service),
    ) as server:
        yield Receiving(server.url, service)
