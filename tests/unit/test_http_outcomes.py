"""httpx failures and responses become the runtime's outcome signals (outbox.http)."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

from outbox.http import (
    error_code,
    http_outcomes,
    outcome_of_response,
    response_json,
    retry_after_of,
)
from outbox.outcomes import (
    LONGEST_RETRY_AFTER,
    DefinitiveRejection,
    EffectSignal,
    InProgress,
    NotSent,
    OutcomeUnknown,
    RateLimited,
)

# A URL with something secret in it: no signal may repeat it.
SECRET_URL = "https://provider.test/refunds?api_key=sk_live_hunter2"

Handler = Callable[[httpx.Request], Any]


async def request_through(handler: Handler) -> httpx.Response:
    async with http_outcomes(), httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        return await http.post(SECRET_URL, json={"amount_cents": 1250})


def raising(error_class: type[httpx.TransportError]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error_class(f"failed talking to {request.url}", request=request)

    return handler


def responding(status: int, body: Any = None, *, content: bytes | None = None) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        if content is not None:
            return httpx.Response(status, content=content)
        return httpx.Response(status, json=body if body is not None else {})

    return handler


async def response_with(status: int, body: Any = None, *, content: bytes | None = None) -> None:
    outcome_of_response(await request_through(responding(status, body, content=content)))


@pytest.mark.parametrize(
    ("error_class", "signal", "code"),
    [
        (httpx.ConnectError, NotSent, "connect_failed"),
        (httpx.ConnectTimeout, NotSent, "connect_timeout"),
        (httpx.PoolTimeout, NotSent, "pool_timeout"),
        (httpx.UnsupportedProtocol, NotSent, "unsupported_protocol"),
        (httpx.ReadTimeout, OutcomeUnknown, "deadline_exceeded"),
        (httpx.WriteTimeout, OutcomeUnknown, "deadline_exceeded"),
        (httpx.RemoteProtocolError, OutcomeUnknown, "connection_lost"),
        (httpx.ReadError, OutcomeUnknown, "connection_lost"),
        (httpx.WriteError, OutcomeUnknown, "connection_lost"),
        (httpx.CloseError, OutcomeUnknown, "connection_lost"),
        (httpx.LocalProtocolError, OutcomeUnknown, "connection_lost"),
        (httpx.ProxyError, OutcomeUnknown, "connection_lost"),
    ],
)
async def test_transport_errors_map_to_signals(
    error_class: type[httpx.TransportError], signal: type[EffectSignal], code: str
) -> None:
    with pytest.raises(EffectSignal) as caught:
        await request_through(raising(error_class))
    assert type(caught.value) is signal
    assert caught.value.code == code


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (httpx.DecodingError("bad gzip"), "response_undecodable"),
        (httpx.TooManyRedirects("loop"), "too_many_redirects"),
        (httpx.RequestError("other"), "request_failed"),
    ],
)
async def test_request_errors_after_a_response_are_unknown(
    error: httpx.RequestError, code: str
) -> None:
    with pytest.raises(OutcomeUnknown) as caught:
        async with http_outcomes():
            raise error
    assert caught.value.code == code


async def test_signal_and_its_traceback_do_not_carry_the_request() -> None:
    with pytest.raises(OutcomeUnknown) as caught:
        await request_through(raising(httpx.ReadTimeout))
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__ is True
    printed = "".join(traceback.format_exception(caught.value))
    assert "hunter2" not in printed
    assert "failed talking to" not in printed
    assert "hunter2" not in str(caught.value)


async def test_cancellation_propagates_untouched() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await request_through(handler)


async def test_non_httpx_errors_pass_through_unchanged() -> None:
    with pytest.raises(KeyError, match="id"):
        async with http_outcomes():
            raise KeyError("id")


@pytest.mark.parametrize("status", [200, 201, 202, 204])
async def test_2xx_is_success(status: int) -> None:
    await response_with(status)


async def test_409_is_key_in_flight() -> None:
    with pytest.raises(InProgress) as caught:
        await response_with(409, {"error": "request_in_progress"})
    assert caught.value.code == "key_in_flight"
    assert caught.value.retry_after is None
    # Still an unknown outcome: a handler written before InProgress existed catches it.
    assert isinstance(caught.value, OutcomeUnknown)


async def test_in_flight_statuses_are_configurable() -> None:
    response = await request_through(responding(423, {"error": "locked"}))
    with pytest.raises(InProgress) as caught:
        outcome_of_response(response, in_flight_statuses=(409, 423))
    assert caught.value.code == "key_in_flight"
    with pytest.raises(DefinitiveRejection) as rejected:
        outcome_of_response(response)
    assert rejected.value.code == "locked"


async def test_409_outside_in_flight_statuses_is_a_rejection() -> None:
    response = await request_through(responding(409, {"error": "conflict"}))
    with pytest.raises(DefinitiveRejection) as caught:
        outcome_of_response(response, in_flight_statuses=())
    assert caught.value.code == "conflict"


async def test_429_is_rate_limited_not_a_retry_the_runtime_may_make_at_once() -> None:
    with pytest.raises(RateLimited) as caught:
        await response_with(429, {"error": "rate_limited"})
    assert caught.value.code == "rate_limited"
    assert caught.value.retry_after is None


def answer(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, json={}, headers=headers)


@pytest.mark.parametrize(
    ("status", "signal"),
    [(429, RateLimited), (409, InProgress), (503, OutcomeUnknown)],
)
def test_the_signal_carries_the_retry_after_of_429_409_and_503(
    status: int, signal: type[EffectSignal]
) -> None:
    with pytest.raises(EffectSignal) as caught:
        outcome_of_response(answer(status, **{"Retry-After": "7"}))
    assert type(caught.value) is signal
    assert caught.value.retry_after == timedelta(seconds=7)


@pytest.mark.parametrize("status", [500, 502, 504, 408])
def test_other_errors_ignore_a_retry_after(status: int) -> None:
    # RFC 9110 gives Retry-After a meaning on 503 and 429 only.
    with pytest.raises(OutcomeUnknown) as caught:
        outcome_of_response(answer(status, **{"Retry-After": "7"}))
    assert caught.value.retry_after is None


def test_a_retry_after_on_a_rejection_or_a_success_changes_nothing() -> None:
    outcome_of_response(answer(201, **{"Retry-After": "7"}))
    with pytest.raises(DefinitiveRejection):
        outcome_of_response(answer(400, **{"Retry-After": "7"}))


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("0", 0.0),
        ("120", 120.0),
        (" 3 ", 3.0),
        ("1.5", 1.5),
        # Not RFC delta-seconds, but unambiguous: no wait.
        ("-5", 0.0),
        # Longer than any provider may park its operations.
        ("86400", LONGEST_RETRY_AFTER.total_seconds()),
        ("9" * 400, LONGEST_RETRY_AFTER.total_seconds()),
    ],
)
def test_retry_after_in_seconds(value: str, seconds: float) -> None:
    assert retry_after_of(answer(429, **{"Retry-After": value})) == timedelta(seconds=seconds)


def test_retry_after_as_a_date_counts_from_the_providers_clock() -> None:
    sent = datetime(2026, 12, 2, 9, 0, 0, tzinfo=UTC)
    headers = {
        "Date": format_datetime(sent, usegmt=True),
        "Retry-After": format_datetime(sent + timedelta(seconds=30), usegmt=True),
    }
    assert retry_after_of(answer(503, **headers)) == timedelta(seconds=30)


def test_retry_after_as_a_date_without_a_date_header_counts_from_our_clock() -> None:
    later = datetime.now(UTC) + timedelta(seconds=90)
    delay = retry_after_of(answer(429, **{"Retry-After": format_datetime(later, usegmt=True)}))
    assert delay is not None
    # The header has whole seconds; a slow machine spends some before the parse.
    assert timedelta(seconds=80) <= delay <= timedelta(seconds=90)


@pytest.mark.parametrize(
    "value",
    ["Wed, 21 Oct 2015 07:28:00 GMT", "Wed, 21 Oct 2015 07:28:00 -0000"],
)
def test_retry_after_as_a_date_in_the_past_is_no_wait(value: str) -> None:
    assert retry_after_of(answer(429, **{"Retry-After": value})) == timedelta(0)


def test_retry_after_as_a_date_far_ahead_is_the_longest_wait() -> None:
    far = format_datetime(datetime.now(UTC) + timedelta(days=3), usegmt=True)
    assert retry_after_of(answer(429, **{"Retry-After": far})) == LONGEST_RETRY_AFTER


@pytest.mark.parametrize(
    "value",
    [
        "",
        "soon",
        "1e3",
        "0x10",
        "nan",
        "inf",
        "5 seconds",
        "5, 7",
        "Mon",
        "31 Feb 2015 07:28:00 GMT",
        "Wed, 21 Oct 99999 07:28:00 GMT",
        "Wed, 21 Oct 2015 25:61:00 GMT",
    ],
)
def test_a_retry_after_that_is_neither_seconds_nor_a_date_is_ignored(value: str) -> None:
    assert retry_after_of(answer(429, **{"Retry-After": value})) is None
    with pytest.raises(RateLimited) as caught:
        outcome_of_response(answer(429, **{"Retry-After": value}))
    assert caught.value.retry_after is None


def test_no_retry_after_is_none() -> None:
    assert retry_after_of(answer(429)) is None


def test_a_garbled_date_header_falls_back_to_our_clock() -> None:
    later = datetime.now(UTC) + timedelta(seconds=60)
    headers = {"Date": "yesterday", "Retry-After": format_datetime(later, usegmt=True)}
    delay = retry_after_of(answer(503, **headers))
    assert delay is not None
    assert timedelta(seconds=50) <= delay <= timedelta(seconds=60)


async def test_408_is_unknown_because_intermediaries_send_it_after_forwarding() -> None:
    with pytest.raises(OutcomeUnknown) as caught:
        await response_with(408)
    assert caught.value.code == "http_408"


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_5xx_is_unknown_with_the_status_as_code(status: int) -> None:
    with pytest.raises(OutcomeUnknown) as caught:
        await response_with(status, {"error": "unavailable"})
    assert caught.value.code == f"http_{status}"


async def test_3xx_is_unknown() -> None:
    with pytest.raises(OutcomeUnknown) as caught:
        await response_with(303)
    assert caught.value.code == "http_303"


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (402, {"error": "amount_exceeds_payment"}, "amount_exceeds_payment"),
        (404, {"error": "payment_not_found"}, "payment_not_found"),
        (400, {"error": {"code": "parameter_missing", "message": "x"}}, "parameter_missing"),
        (400, {"error": "Amount must be positive, got -5"}, "http_400"),
        (400, {"error": "x" * 65}, "http_400"),
        (400, {"error": 42}, "http_400"),
        (403, {"message": "forbidden"}, "http_403"),
        (422, ["not", "an", "object"], "http_422"),
    ],
)
async def test_other_4xx_is_a_rejection_with_a_safe_code(status: int, body: Any, code: str) -> None:
    with pytest.raises(DefinitiveRejection) as caught:
        await response_with(status, body)
    assert caught.value.code == code


async def test_4xx_with_a_body_that_is_not_json_uses_the_status() -> None:
    with pytest.raises(DefinitiveRejection) as caught:
        await response_with(404, content=b"<html>Not Found</html>")
    assert caught.value.code == "http_404"


async def test_error_code_of_an_unread_stream_is_none() -> None:
    async def stream() -> Any:
        yield b'{"error": "payment_not_found"}'

    response = httpx.Response(404, content=stream())
    assert error_code(response) is None


async def test_response_json_returns_the_object() -> None:
    response = await request_through(responding(201, {"id": "re_1", "status": "succeeded"}))
    assert response_json(response) == {"id": "re_1", "status": "succeeded"}


@pytest.mark.parametrize("content", [b"", b"not json", b"[1, 2]", b"\xff\xfe"])
async def test_response_json_of_an_unreadable_success_is_unknown(content: bytes) -> None:
    response = await request_through(responding(201, content=content))
    with pytest.raises(OutcomeUnknown) as caught:
        response_json(response)
    assert caught.value.code == "malformed_response"
