"""The sandbox example tools against an httpx.MockTransport (outbox.sandbox.tools)."""

from __future__ import annotations

import json
import ssl
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ValidationError

from outbox.contracts import OnUnknown, SideEffect
from outbox.errors import InputRejected
from outbox.intent import prepare_decision
from outbox.outcomes import (
    DefinitiveRejection,
    EffectResult,
    EffectSignal,
    ExecutionContext,
    Found,
    InProgress,
    NotFound,
    NotSent,
    OutcomeUnknown,
    RateLimited,
    StillUnknown,
    Unreachable,
)
from outbox.sandbox import tools
from outbox.sandbox.tools import EmailInput, RefundInput, RefundLookup

Handler = Callable[[httpx.Request], httpx.Response]


class Provider:
    """Answers every request with one handler and keeps what it was sent."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []
        self.base_urls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handler(request)

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> Callable[[Handler], Provider]:
    def install(handler: Handler) -> Provider:
        fake = Provider(handler)

        def factory() -> httpx.AsyncClient:
            # Built like the real factory, so the base URL still comes from the env.
            fake.base_urls.append(tools.sandbox_url())
            return httpx.AsyncClient(
                transport=httpx.MockTransport(fake), base_url=tools.sandbox_url()
            )

        monkeypatch.setattr(tools, "_client_factory", factory)
        return fake

    return install


def reply(status: int, body: Any) -> Handler:
    return lambda request: httpx.Response(status, json=body)


def failing(error_class: type[httpx.TransportError]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error_class("injected", request=request)

    return handler


def context(seconds: float = 5.0) -> ExecutionContext:
    return ExecutionContext(
        operation_id=uuid.uuid4(), attempt=1, deadline=time.monotonic() + seconds
    )


REFUND = RefundInput(payment_id="pay_abc123", amount_cents=1250, reason="damaged")
SUCCEEDED = {"id": "re_9f8e", "status": "succeeded", "payment_id": "pay_abc123"}


# --- send_refund -----------------------------------------------------------------------


async def test_send_refund_posts_with_the_operation_id_as_idempotency_key(
    provider: Callable[[Handler], Provider], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_SANDBOX_URL", "http://sandbox.test:8611")
    fake = provider(reply(201, SUCCEEDED))
    ctx = context()
    result = await tools.send_refund(REFUND, ctx)
    assert result == EffectResult(provider_reference="re_9f8e", result={"status": "succeeded"})
    sent = fake.last
    assert sent.method == "POST"
    assert str(sent.url) == "http://sandbox.test:8611/refunds"
    assert sent.headers["Idempotency-Key"] == str(ctx.operation_id)
    assert json.loads(sent.content) == {
        "payment_id": "pay_abc123",
        "amount_cents": 1250,
        "currency": "EUR",
        "reason": "damaged",
    }


async def test_every_attempt_of_one_operation_sends_the_same_key(
    provider: Callable[[Handler], Provider],
) -> None:
    fake = provider(reply(201, SUCCEEDED))
    ctx = context()
    await tools.send_refund(REFUND, ctx)
    await tools.send_refund(REFUND, ExecutionContext(ctx.operation_id, 2, ctx.deadline))
    keys = {request.headers["Idempotency-Key"] for request in fake.requests}
    assert keys == {str(ctx.operation_id)}


async def test_the_sandbox_url_is_read_at_call_time(
    provider: Callable[[Handler], Provider], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = provider(reply(201, SUCCEEDED))
    monkeypatch.delenv("OUTBOX_SANDBOX_URL", raising=False)
    await tools.send_refund(REFUND, context())
    monkeypatch.setenv("OUTBOX_SANDBOX_URL", "http://elsewhere.test:9000")
    await tools.send_refund(REFUND, context())
    assert fake.base_urls == ["http://127.0.0.1:8600", "http://elsewhere.test:9000"]


async def test_the_default_client_uses_the_sandbox_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_SANDBOX_URL", "http://sandbox.test:8612")
    async with tools._default_client() as client:
        assert str(client.base_url) == "http://sandbox.test:8612"


async def test_the_default_clients_share_one_tls_context_that_still_verifies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each client built without a context loads the CA certificates again (52 ms of CPU
    # on a two-core host): count how often one is built for five calls' clients.
    built: list[ssl.SSLContext] = []
    original = ssl.create_default_context

    def counted(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(ssl, "create_default_context", counted)
    tools._tls_context.cache_clear()
    try:
        for _ in range(5):
            async with tools._default_client():
                pass
        shared = tools._tls_context()
    finally:
        tools._tls_context.cache_clear()

    assert built == [shared]
    assert shared.verify_mode is ssl.CERT_REQUIRED
    assert shared.check_hostname


async def test_send_refund_passes_the_remaining_deadline_as_timeout(
    provider: Callable[[Handler], Provider],
) -> None:
    fake = provider(reply(201, SUCCEEDED))
    await tools.send_refund(REFUND, context(seconds=2.0))
    timeouts = fake.last.extensions["timeout"]
    assert 0 < timeouts["read"] <= 2.0
    assert timeouts["connect"] == timeouts["read"]


async def test_send_refund_after_the_deadline_sends_nothing(
    provider: Callable[[Handler], Provider],
) -> None:
    fake = provider(reply(201, SUCCEEDED))
    with pytest.raises(NotSent) as caught:
        await tools.send_refund(REFUND, context(seconds=-1.0))
    assert caught.value.code == "deadline_passed"
    assert fake.requests == []


@pytest.mark.parametrize(
    ("status", "body", "signal", "code"),
    [
        (402, {"error": "amount_exceeds_payment"}, DefinitiveRejection, "amount_exceeds_payment"),
        (404, {"error": "payment_not_found"}, DefinitiveRejection, "payment_not_found"),
        (400, {"error": "invalid_request"}, DefinitiveRejection, "invalid_request"),
        (409, {"error": "request_in_progress"}, InProgress, "key_in_flight"),
        (422, {"error": "idempotency_key_reused"}, OutcomeUnknown, "idempotency_key_reused"),
        (503, {"error": "unavailable"}, OutcomeUnknown, "http_503"),
        (429, {"error": "rate_limited"}, RateLimited, "rate_limited"),
        (201, {"status": "succeeded"}, OutcomeUnknown, "malformed_response"),
    ],
)
async def test_send_refund_maps_each_provider_answer(
    provider: Callable[[Handler], Provider],
    status: int,
    body: Any,
    signal: type[EffectSignal],
    code: str,
) -> None:
    provider(reply(status, body))
    with pytest.raises(EffectSignal) as caught:
        await tools.send_refund(REFUND, context())
    assert type(caught.value) is signal
    assert caught.value.code == code


async def test_send_refund_other_422_is_a_rejection(
    provider: Callable[[Handler], Provider],
) -> None:
    provider(reply(422, {"error": "currency_unsupported"}))
    with pytest.raises(DefinitiveRejection) as caught:
        await tools.send_refund(REFUND, context())
    assert caught.value.code == "currency_unsupported"


@pytest.mark.parametrize(
    ("error_class", "signal", "code"),
    [
        (httpx.ConnectError, NotSent, "connect_failed"),
        (httpx.ConnectTimeout, NotSent, "connect_timeout"),
        (httpx.ReadTimeout, OutcomeUnknown, "deadline_exceeded"),
        (httpx.RemoteProtocolError, OutcomeUnknown, "connection_lost"),
        (httpx.ReadError, OutcomeUnknown, "connection_lost"),
    ],
)
async def test_send_refund_maps_transport_failures(
    provider: Callable[[Handler], Provider],
    error_class: type[httpx.TransportError],
    signal: type[EffectSignal],
    code: str,
) -> None:
    provider(failing(error_class))
    with pytest.raises(EffectSignal) as caught:
        await tools.send_refund(REFUND, context())
    assert type(caught.value) is signal
    assert caught.value.code == code


# --- send_refund's reconcile -------------------------------------------------------------


async def test_find_refund_looks_up_by_the_operation_id(
    provider: Callable[[Handler], Provider],
) -> None:
    fake = provider(reply(200, SUCCEEDED))
    ctx = context()
    found = await tools.find_refund(REFUND, ctx)
    assert found == Found(provider_reference="re_9f8e", result={"status": "succeeded"})
    assert fake.last.method == "GET"
    assert fake.last.url.path == "/refunds"
    assert fake.last.url.params["idempotency_key"] == str(ctx.operation_id)


async def test_find_refund_not_found_only_on_the_providers_explicit_answer(
    provider: Callable[[Handler], Provider],
) -> None:
    provider(reply(404, {"error": "not_found"}))
    assert await tools.find_refund(REFUND, context()) == NotFound()


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (404, {"error": "no_such_route"}, "no_such_route"),
        (404, {}, "http_404"),
        (409, {"error": "request_in_progress"}, "key_in_flight"),
        (200, {"status": "succeeded"}, "malformed_response"),
        (204, {}, "http_204"),
        (400, {"error": "invalid_request"}, "invalid_request"),
    ],
)
async def test_find_refund_an_answer_that_decides_nothing_is_still_unknown(
    provider: Callable[[Handler], Provider], status: int, body: Any, code: str
) -> None:
    provider(reply(status, body))
    assert await tools.find_refund(REFUND, context()) == StillUnknown(code)


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (503, {"error": "lookups_unavailable"}, "http_503"),
        (503, {"error": "service_unavailable"}, "http_503"),
        (500, {}, "http_500"),
        (502, {}, "http_502"),
        (504, {}, "http_504"),
        (408, {}, "http_408"),
        (429, {"error": "rate_limited"}, "rate_limited"),
    ],
)
async def test_find_refund_a_provider_that_could_not_be_asked_is_unreachable(
    provider: Callable[[Handler], Provider], status: int, body: Any, code: str
) -> None:
    provider(reply(status, body))
    assert await tools.find_refund(REFUND, context()) == Unreachable(code)


@pytest.mark.parametrize("status", [429, 503])
async def test_find_refund_passes_the_providers_retry_after_on(
    provider: Callable[[Handler], Provider], status: int
) -> None:
    provider(lambda request: httpx.Response(status, json={}, headers={"Retry-After": "4"}))
    found = await tools.find_refund(REFUND, context())
    assert isinstance(found, Unreachable)
    assert found.retry_after == timedelta(seconds=4)


@pytest.mark.parametrize(
    ("error_class", "code"),
    [
        (httpx.ConnectError, "connect_failed"),
        (httpx.ConnectTimeout, "connect_timeout"),
        (httpx.ReadTimeout, "deadline_exceeded"),
        (httpx.RemoteProtocolError, "connection_lost"),
        (httpx.ReadError, "connection_lost"),
    ],
)
async def test_find_refund_transport_failures_are_unreachable(
    provider: Callable[[Handler], Provider], error_class: type[httpx.TransportError], code: str
) -> None:
    provider(failing(error_class))
    assert await tools.find_refund(REFUND, context()) == Unreachable(code)


async def test_find_refund_an_unreadable_answer_is_still_unknown(
    provider: Callable[[Handler], Provider],
) -> None:
    # A response came (only its body is undecodable): the provider was asked.
    def undecodable(request: httpx.Request) -> httpx.Response:
        raise httpx.DecodingError("bad gzip", request=request)

    provider(undecodable)
    assert await tools.find_refund(REFUND, context()) == StillUnknown("response_undecodable")


async def test_find_refund_after_the_deadline_is_still_unknown(
    provider: Callable[[Handler], Provider],
) -> None:
    fake = provider(reply(200, SUCCEEDED))
    assert await tools.find_refund(REFUND, context(seconds=-1.0)) == StillUnknown("deadline_passed")
    assert fake.requests == []


# --- get_refund --------------------------------------------------------------------------


async def test_get_refund_reads_the_refund(provider: Callable[[Handler], Provider]) -> None:
    fake = provider(reply(200, {**SUCCEEDED, "amount_cents": 1250, "currency": "EUR"}))
    result = await tools.get_refund(RefundLookup(refund_id="re_9f8e"), context())
    assert result == EffectResult(
        provider_reference="re_9f8e",
        result={
            "status": "succeeded",
            "payment_id": "pay_abc123",
            "amount_cents": 1250,
            "currency": "EUR",
        },
    )
    assert fake.last.method == "GET"
    assert fake.last.url.path == "/refunds/re_9f8e"


async def test_get_refund_missing_is_a_rejection(provider: Callable[[Handler], Provider]) -> None:
    provider(reply(404, {"error": "not_found"}))
    with pytest.raises(DefinitiveRejection) as caught:
        await tools.get_refund(RefundLookup(refund_id="re_gone"), context())
    assert caught.value.code == "refund_not_found"


async def test_get_refund_outage_is_unknown(provider: Callable[[Handler], Provider]) -> None:
    provider(reply(503, {"error": "unavailable"}))
    with pytest.raises(OutcomeUnknown) as caught:
        await tools.get_refund(RefundLookup(refund_id="re_9f8e"), context())
    assert caught.value.code == "http_503"


@pytest.mark.parametrize("refund_id", ["re_../../admin/reset", "re_1?x=1", "pay_1", "re_"])
def test_refund_ids_that_would_change_the_url_are_refused(refund_id: str) -> None:
    with pytest.raises(ValueError, match="refund_id"):
        RefundLookup(refund_id=refund_id)


# --- send_email --------------------------------------------------------------------------


EMAIL = EmailInput(to="ada@example.com", subject="Your refund", body="It is on its way.")


async def test_send_email_posts_the_email(provider: Callable[[Handler], Provider]) -> None:
    fake = provider(reply(202, {"id": "em_77", "status": "sent"}))
    result = await tools.send_email(EMAIL, context())
    assert result == EffectResult(provider_reference="em_77", result={"status": "sent"})
    assert fake.last.method == "POST"
    assert fake.last.url.path == "/emails"
    assert json.loads(fake.last.content) == {
        "to": "ada@example.com",
        "subject": "Your refund",
        "body": "It is on its way.",
    }


@pytest.mark.parametrize(
    ("handler", "signal", "code"),
    [
        (reply(400, {"error": "invalid_request"}), DefinitiveRejection, "invalid_request"),
        (reply(503, {"error": "unavailable"}), OutcomeUnknown, "http_503"),
        (reply(202, {"status": "sent"}), OutcomeUnknown, "malformed_response"),
        (failing(httpx.ConnectError), NotSent, "connect_failed"),
        (failing(httpx.RemoteProtocolError), OutcomeUnknown, "connection_lost"),
        (failing(httpx.ReadTimeout), OutcomeUnknown, "deadline_exceeded"),
    ],
)
async def test_send_email_maps_each_failure(
    provider: Callable[[Handler], Provider],
    handler: Handler,
    signal: type[EffectSignal],
    code: str,
) -> None:
    provider(handler)
    with pytest.raises(EffectSignal) as caught:
        await tools.send_email(EMAIL, context())
    assert type(caught.value) is signal
    assert caught.value.code == code


@pytest.mark.parametrize("address", ["ada", "ada@", "@example.com", "a b@example.com"])
def test_email_addresses_must_look_like_addresses(address: str) -> None:
    with pytest.raises(ValueError, match="to"):
        EmailInput(to=address, subject="s", body="b")


# --- the registry --------------------------------------------------------------------------


def test_registry_holds_the_three_contracts_as_specified() -> None:
    registry = tools.build_registry()
    assert [c.label for c in registry] == ["'get_refund' v1", "'send_email' v1", "'send_refund' v1"]
    refund = registry.get("send_refund", 1)
    assert refund.side_effect is SideEffect.DEDUPLICATED_WRITE
    assert refund.dedupe_window == timedelta(hours=24)
    assert refund.reconcile is tools.find_refund
    assert refund.deadline == timedelta(seconds=5)
    assert (refund.retry.max_attempts, refund.retry.reconcile_max_attempts) == (5, 5)
    assert refund.retry.initial_backoff == timedelta(milliseconds=200)
    assert refund.retry.max_backoff == timedelta(seconds=5)
    email = registry.get("send_email", 1)
    assert email.side_effect is SideEffect.NON_REPEATABLE_WRITE
    assert email.reconcile is None
    assert email.on_unknown is OnUnknown.ESCALATE
    assert registry.get("get_refund", 1).side_effect is SideEffect.READ_ONLY
    assert isinstance(tools.registry, type(registry))
    assert len(tools.registry) == 3


def test_refunds_above_500_euros_need_approval() -> None:
    approval = tools.registry.get("send_refund", 1).approval
    assert not approval.applies_to(RefundInput(payment_id="pay_1", amount_cents=50_000))
    assert approval.applies_to(RefundInput(payment_id="pay_1", amount_cents=50_001))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"payment_id": "ch_1", "amount_cents": 100}, "payment_id"),
        ({"payment_id": "pay_1", "amount_cents": 0}, "amount_cents"),
        ({"payment_id": "pay_1", "amount_cents": 100, "currency": "eur"}, "currency"),
        ({"payment_id": "pay_1", "amount_cents": 100, "reason": "x" * 501}, "reason"),
    ],
)
def test_refund_input_refuses_what_the_provider_would(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        RefundInput(**fields)
    assert [error["loc"] for error in refused.value.errors()] == [(field,)]


@pytest.mark.parametrize(
    ("model", "fields", "field"),
    [
        (RefundInput, {"payment_id": "pay_1", "amount_cents": True}, "amount_cents"),
        (RefundInput, {"payment_id": "pay_1", "amount_cents": "100"}, "amount_cents"),
        (RefundInput, {"payment_id": "pay_1", "amount_cents": 100.0}, "amount_cents"),
        (RefundLookup, {"refund_id": b"re_1"}, "refund_id"),
        (EmailInput, {"to": "a@example.com", "subject": b"hi", "body": ""}, "subject"),
    ],
)
def test_inputs_are_strict_no_bool_for_an_amount_no_coerced_strings(
    model: type[BaseModel], fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        model.model_validate(fields)
    assert [error["loc"] for error in refused.value.errors()] == [(field,)]


def test_a_boolean_amount_is_refused_before_anything_is_recorded() -> None:
    with pytest.raises(InputRejected) as refused:
        prepare_decision(
            tools.registry, "send_refund", {"payment_id": "pay_1", "amount_cents": True}, run_id="r"
        )
    assert refused.value.problems == ["amount_cents: Input should be a valid integer"]
