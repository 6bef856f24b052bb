"""examples/stripe_callbacks.py, the Stripe-style example docs/callbacks.md shows: a
refund webhook as Stripe sends it, signed by Stripe's own library, received by the
example's Starlette route (as a login of outbox_callbacks) and applied by the consumer's
reconciler: the unknown outcome of the refund is committed with Stripe's refund id."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
import stripe
from starlette.testclient import TestClient

from consumer.worker import Consumer
from outbox import OperationState, Settings, record_decision
from outbox import store as outbox_store
from outbox.callbacks import CallbackReceiver
from outbox.store import Store

from support.logins import Login, group_logins

S = OperationState
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stripe_callbacks.py"
SECRET = "whsec_example_endpoint_secret_01"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stripe_callbacks_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def login(postgres_server_url: str, database_url: str) -> Iterator[Login]:
    with group_logins(postgres_server_url, database_url) as make:
        yield make


def stripe_event(operation_id: str, status: str = "succeeded") -> dict[str, Any]:
    """A refund.updated event in the shape Stripe sends it (abridged)."""
    return {
        "id": "evt_3PqRsT2eZvKYlo2C0abcdEFG",
        "object": "event",
        "api_version": "2024-06-20",
        "type": "refund.updated",
        "data": {
            "object": {
                "id": "re_3PqRsT2eZvKYlo2C1xyz",
                "object": "refund",
                "amount": 1250,
                "currency": "eur",
                "payment_intent": "pi_3PqRsT2eZvKYlo2C",
                "status": status,
                "metadata": {"outbox_operation_id": operation_id},
            }
        },
    }


def post(client: TestClient, payload: dict[str, Any], secret: str = SECRET) -> Any:
    body = json.dumps(payload)
    header = stripe.WebhookSignature.generate_signature_header(body, secret)
    return client.post(
        "/webhooks/stripe",
        content=body,
        headers={"Stripe-Signature": header, "Content-Type": "application/json"},
    )


async def test_a_refund_webhook_signed_by_stripe_settles_the_unknown_outcome(
    example: ModuleType, login: Login, database_url: str, settings: Settings
) -> None:
    with psycopg.connect(database_url) as connection:
        runner = Store(connection)
        recorded = record_decision(
            connection,
            example.registry,
            "stripe_refund",
            {"payment_intent": "pi_3PqRsT2eZvKYlo2C", "amount": 1250},
            run_id="run",
        )
        claimed = runner.run(
            outbox_store.claim(recorded.operation.id, owner="w", lease=timedelta(minutes=1))
        )
        assert claimed is not None
        # The response to POST /v1/refunds was lost: the outcome is unknown.
        runner.run(
            outbox_store.transition(
                claimed.id,
                source=S.IN_FLIGHT,
                target=S.OUTCOME_UNKNOWN,
                lease_token=claimed.lease_token,
                error_class="connection_lost",
                delay=timedelta(hours=1),
            )
        )
    receiver = CallbackReceiver(example.registry, {"stripe": (SECRET,)})
    app = example.create_app(receiver, login("outbox_callbacks"))
    payload = stripe_event(str(recorded.operation.id))

    with TestClient(app) as client:
        first = post(client, payload)
        again = post(client, payload)
        forged = post(client, payload, secret="whsec_not_the_endpoints_secret")
    consumer = Consumer(settings, example.registry)
    try:
        await consumer.reconciler.reconcile_once()
    finally:
        await consumer.close()

    assert (first.status_code, first.json()) == (200, {"result": "recorded"})
    assert again.json() == {"result": "duplicate"}
    assert (forged.status_code, forged.json()) == (400, {"error": "signature"})
    with psycopg.connect(database_url) as connection:
        runner = Store(connection)
        settled = runner.run(outbox_store.get_operation(recorded.operation.id))
        last = runner.run(outbox_store.events(recorded.operation.id))[-1]
    assert (settled.state, settled.provider_reference) == (S.COMMITTED, "re_3PqRsT2eZvKYlo2C1xyz")
    assert (last.name, last.attributes["method"]) == ("operation.reconciled", "callback")


def test_the_docs_show_the_example_as_it_is_tested() -> None:
    docs = (EXAMPLE.parents[1] / "docs" / "callbacks.md").read_text(encoding="utf-8")
    assert f"```python\n{EXAMPLE.read_text(encoding='utf-8')}```" in docs
