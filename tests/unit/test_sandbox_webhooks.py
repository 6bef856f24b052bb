"""The payment sandbox's webhooks: after each committed refund (Stripe-signed) and each
accepted email (Standard Webhooks), a signed callback to the configured receiver, with
faults to inject: duplicate, delay, reorder, drop, forged signature, stale timestamp.
Received here by a plain HTTP server and checked with outbox.callbacks.verify's verifiers and
the sandbox providers' own readers, as `outbox callbacks serve` would."""

from __future__ import annotations

import base64
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.callbacks.verify import StandardWebhooksVerifier, StripeVerifier
from outbox.errors import CallbackRefused
from outbox.sandbox import cli
from outbox.sandbox.provider import SandboxProvider
from outbox.sandbox.webhooks import EMAIL, PAYMENTS, WebhookTarget

from support.logs import rendered
from support.waiting import eventually_sync

PAYMENTS_SECRET = "whsec_sandbox_payments_0123456789"
EMAIL_SECRET = "whsec_" + base64.b64encode(b"sandbox-email-secret-32-bytes!!!").decode()
SECRETS = {PAYMENTS.name: (PAYMENTS_SECRET,), EMAIL.name: (EMAIL_SECRET,)}
VERIFIERS: dict[str, StripeVerifier | StandardWebhooksVerifier] = {
    PAYMENTS.name: StripeVerifier((PAYMENTS_SECRET,)),
    EMAIL.name: StandardWebhooksVerifier((EMAIL_SECRET,)),
}
READERS = {PAYMENTS.name: PAYMENTS.read, EMAIL.name: EMAIL.read}
WITHIN = 10.0


@dataclass
class Received:
    provider: str
    body: bytes
    headers: dict[str, str]

    def verify(self) -> str:
        return VERIFIERS[self.provider].verify(self.body, self.headers)

    def report(self) -> CallbackReport | None:
        return READERS[self.provider](json.loads(self.body), self.verify())


@dataclass
class Collector:
    """A receiver that keeps every request; ``fail`` answers 503 that many times first."""

    received: list[Received] = field(default_factory=list)
    fail: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, provider: str, body: bytes, headers: dict[str, str]) -> int:
        with self.lock:
            self.received.append(Received(provider, body, headers))
            if self.fail:
                self.fail -= 1
                return 503
            return 200


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    kept = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            provider = self.path.removeprefix("/callbacks/")
            status = kept.take(provider, body, {k.lower(): v for k, v in self.headers.items()})
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    try:
        yield kept, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def sandbox(collector: tuple[Collector, str]) -> Iterator[SandboxProvider]:
    with SandboxProvider(webhooks=WebhookTarget(collector[1], SECRETS)) as running:
        yield running


@pytest.fixture
def client(sandbox: SandboxProvider) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sandbox.url, timeout=WITHIN) as http:
        yield http


def refund(client: httpx.Client, key: str, amount_cents: int = 500) -> httpx.Response:
    body = {"payment_id": "pay_1", "amount_cents": amount_cents, "currency": "EUR"}
    return client.post("/refunds", json=body, headers={"Idempotency-Key": key})


def email(client: httpx.Client, reference: str | None) -> httpx.Response:
    body = {"to": "customer@example.com", "subject": "Your refund", "body": "Sent today."}
    headers = {"X-Reference": reference} if reference else {}
    return client.post("/emails", json=body, headers=headers)


def received(collector: Collector, count: int) -> list[Received]:
    eventually_sync(
        lambda: len(collector.received) >= count, within=WITHIN, what=f"{count} webhook(s)"
    )
    return list(collector.received)


def test_a_committed_refund_is_reported_by_a_stripe_signed_webhook(
    collector: tuple[Collector, str], client: httpx.Client
) -> None:
    key = str(uuid.uuid4())
    created = refund(client, key).json()

    [webhook] = received(collector[0], 1)

    assert webhook.provider == "sandbox-payments"
    assert "stripe-signature" in webhook.headers
    report = webhook.report()
    assert report is not None
    assert report.status is CallbackStatus.COMMITTED
    assert (str(report.operation_id), report.provider_reference) == (key, created["id"])
    assert report.event_id.startswith("evt_")


def test_a_declined_refund_is_reported_as_failed(
    collector: tuple[Collector, str], client: httpx.Client
) -> None:
    assert refund(client, str(uuid.uuid4()), amount_cents=10**9).status_code == 402

    [webhook] = received(collector[0], 1)

    report = webhook.report()
    assert report is not None
    assert report.status is CallbackStatus.REJECTED


def test_an_accepted_email_is_reported_delivered_with_its_reference(
    collector: tuple[Collector, str], client: httpx.Client
) -> None:
    reference = str(uuid.uuid4())
    sent = email(client, reference).json()

    [webhook] = received(collector[0], 1)

    assert webhook.provider == "sandbox-email"
    assert {"webhook-id", "webhook-timestamp", "webhook-signature"} <= set(webhook.headers)
    report = webhook.report()
    assert report is not None
    assert (report.status, str(report.operation_id)) == (CallbackStatus.COMMITTED, reference)
    assert report.provider_reference == sent["id"]
    assert report.event_id == webhook.headers["webhook-id"]
    # The ledger counts emails by that reference: one decision, one email, or not.
    email(client, reference)
    assert client.get("/ledger").json()["emails_by_reference"] == {reference: 2}


def test_a_replayed_refund_sends_no_second_event(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    key = str(uuid.uuid4())
    refund(client, key)
    refund(client, key)
    email(client, None)  # a later event, to know the queue was drained

    webhooks = received(collector[0], 2)

    assert [w.provider for w in webhooks] == ["sandbox-payments", "sandbox-email"]


def test_a_lost_response_still_sends_the_webhook(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    sandbox.set_faults(drop_response_every=1)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        refund(client, str(uuid.uuid4()))

    [webhook] = received(collector[0], 1)

    report = webhook.report()
    assert report is not None
    assert report.status is CallbackStatus.COMMITTED


def test_a_receiver_that_fails_is_sent_the_same_event_again(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    collector[0].fail = 2
    email(client, str(uuid.uuid4()))

    first, second, third = received(collector[0], 3)

    assert (
        first.headers["webhook-id"] == second.headers["webhook-id"] == third.headers["webhook-id"]
    )
    eventually_sync(
        lambda: [d["status"] for d in sandbox.webhooks()] == [503, 503, 200],
        within=WITHIN,
        what="the deliveries to be logged",
    )


def test_the_duplicate_fault_sends_one_event_twice(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    sandbox.set_faults(webhook_duplicate_every=1)
    refund(client, str(uuid.uuid4()))

    first, second = received(collector[0], 2)

    assert first.report() == second.report()


def test_the_drop_fault_sends_nothing(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    sandbox.set_faults(webhook_drop_every=3)
    for _ in range(3):
        refund(client, str(uuid.uuid4()))
    email(client, None)  # the marker: everything before it was sent or dropped

    webhooks = received(collector[0], 3)

    assert [w.provider for w in webhooks] == ["sandbox-payments"] * 2 + ["sandbox-email"]
    assert [entry["status"] for entry in sandbox.webhooks()].count("dropped") == 1


def test_the_delay_fault_holds_webhooks_until_it_is_lowered(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    sandbox.set_faults(webhook_delay_ms=600_000)
    refund(client, str(uuid.uuid4()))
    eventually_sync(lambda: sandbox.webhooks_waiting() == 1, within=WITHIN, what="the webhook held")
    assert collector[0].received == []

    sandbox.set_faults(webhook_delay_ms=0)

    assert len(received(collector[0], 1)) == 1


def test_the_reorder_fault_sends_a_window_of_events_newest_first(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    sandbox.set_faults(webhook_reorder=3)
    keys = [str(uuid.uuid4()) for _ in range(3)]
    for key in keys:
        refund(client, key)

    webhooks = received(collector[0], 3)

    reports = [w.report() for w in webhooks]
    assert [str(r.operation_id) for r in reports if r] == keys[::-1]


def test_the_forged_fault_signs_with_a_secret_nobody_holds(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    sandbox.set_faults(webhook_forge_every=1)
    refund(client, str(uuid.uuid4()))
    email(client, None)

    webhooks = received(collector[0], 2)

    for webhook in webhooks:
        with pytest.raises(CallbackRefused) as refused:
            webhook.verify()
        assert refused.value.reason == "signature"


def test_the_stale_fault_signs_a_timestamp_outside_the_window(
    sandbox: SandboxProvider, collector: tuple[Collector, str], client: httpx.Client
) -> None:
    sandbox.set_faults(webhook_stale_every=1)
    email(client, None)

    [webhook] = received(collector[0], 1)

    with pytest.raises(CallbackRefused) as refused:
        webhook.verify()
    assert refused.value.reason == "timestamp"


def test_without_a_receiver_nothing_is_sent_and_nothing_waits(client: httpx.Client) -> None:
    with SandboxProvider() as quiet, httpx.Client(base_url=quiet.url) as http:
        refund(http, str(uuid.uuid4()))
        assert quiet.webhooks() == []
        assert quiet.webhooks_waiting() == 0


def test_no_secret_reaches_a_log_line(
    sandbox: SandboxProvider,
    collector: tuple[Collector, str],
    client: httpx.Client,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    refund(client, str(uuid.uuid4()))
    email(client, str(uuid.uuid4()))
    received(collector[0], 2)
    eventually_sync(lambda: len(sandbox.webhooks()) == 2, within=WITHIN, what="both logged")

    text = rendered(caplog)
    assert "provider.webhook.sent" in text
    assert PAYMENTS_SECRET not in text
    assert EMAIL_SECRET not in text
    assert PAYMENTS_SECRET not in repr(sandbox.webhook_target)


def test_the_provider_command_needs_the_secrets_it_signs_with(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OUTBOX_CALLBACK_SECRETS", raising=False)
    monkeypatch.delenv("OUTBOX_CALLBACK_SECRETS_FILE", raising=False)

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code = cli.main(["--port", "0", "--webhook-url", "http://127.0.0.1:9"])
    finally:
        # The command points the root logger at this test's captured stderr: put back
        # what was there, or later lines go to a stream closed with this test.
        root.handlers[:], root.level = handlers, level

    assert code == 2
    err = capsys.readouterr().err
    assert "needs secrets for sandbox-payments, sandbox-email" in err
    assert "OUTBOX_CALLBACK_SECRETS" in err
