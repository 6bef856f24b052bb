"""Turn httpx failures and responses into the runtime's outcome signals.

A tool that calls its provider with httpx wraps the request in :func:`http_outcomes`
and passes the response to :func:`outcome_of_response`::

    TLS = httpx.create_ssl_context()  # once: each build loads the CA certificates

    async with http_outcomes(), httpx.AsyncClient(base_url=..., verify=TLS) as client:
        response = await client.post("/refunds", json=..., headers=...)
    outcome_of_response(response)

The rule behind every mapping: :class:`NotSent` only where the request provably never
left this process, because the runtime may repeat a ``NotSent`` attempt blindly.
Whenever the provider might have seen the request, the answer is
:class:`OutcomeUnknown`, and the runtime looks the effect up before anything else.
Two answers say more: 429 is :class:`RateLimited` (the provider did nothing and asks us
to slow down) and "same key in flight" (409) is :class:`InProgress`, an
:class:`OutcomeUnknown` whose first request may still commit. Both carry the provider's
``Retry-After`` (:func:`retry_after_of`), and so does a 503, which stays
:class:`OutcomeUnknown`: a server error may come after the provider acted.

The signals carry a short code only. The httpx exception is dropped from the chain
(``from None``): its message names the URL, which may carry query parameters or
credentials, and a logged traceback would print it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Collection
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from outbox.outcomes import (
    LONGEST_RETRY_AFTER,
    DefinitiveRejection,
    InProgress,
    NotSent,
    OutcomeUnknown,
    RateLimited,
)

_CODE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
# delta-seconds (RFC 9110 section 10.2.3), with a sign and a fraction tolerated: both
# are unambiguous, and a provider that writes "1.5" or "-1" still means "wait this long".
_DELAY_SECONDS = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")


@contextlib.asynccontextmanager
async def http_outcomes() -> AsyncIterator[None]:
    """Map the httpx exceptions raised inside the block to outcome signals.

    ``asyncio.CancelledError`` is not an ``Exception`` and passes through untouched:
    the runtime cancels at the deadline and classifies that itself.
    """
    try:
        yield
    except httpx.ConnectTimeout:
        # Checked before TimeoutException: no connection was made, nothing was written.
        raise NotSent("connect_timeout") from None
    except httpx.PoolTimeout:
        # Waiting for a free connection from the pool: the request was never written.
        raise NotSent("pool_timeout") from None
    except httpx.TimeoutException:
        # Read or write timeout: the provider may have received all of it and acted.
        raise OutcomeUnknown("deadline_exceeded") from None
    except httpx.ConnectError:
        # Refused, unreachable, DNS or TLS handshake failure: no request bytes were sent.
        raise NotSent("connect_failed") from None
    except httpx.UnsupportedProtocol:
        # Raised while choosing a transport for the URL, before any connection exists.
        raise NotSent("unsupported_protocol") from None
    except httpx.TransportError:
        # RemoteProtocolError, ReadError, WriteError, ProxyError, LocalProtocolError:
        # the connection failed after the request may have been (partly) sent.
        raise OutcomeUnknown("connection_lost") from None
    except httpx.DecodingError:
        # A response arrived, so the request was processed; only its body is unreadable.
        raise OutcomeUnknown("response_undecodable") from None
    except httpx.TooManyRedirects:
        raise OutcomeUnknown("too_many_redirects") from None
    except httpx.RequestError:
        raise OutcomeUnknown("request_failed") from None


def error_code(response: httpx.Response) -> str | None:
    """The provider's error code from a JSON body, if it is a safe code.

    Accepts ``{"error": "code"}`` and Stripe's ``{"error": {"code": "code"}}``. The
    code becomes a metric label and an event attribute, so anything outside the code
    alphabet (free text, ids with capitals, long strings) is ignored.
    """
    body = _json_or_none(response)
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        error = error.get("code")
    if isinstance(error, str) and _CODE.fullmatch(error):
        return error
    return None


def retry_after_of(response: httpx.Response) -> timedelta | None:
    """How long the provider asked us to wait (its ``Retry-After``), or None.

    Takes delta-seconds or an HTTP-date; a negative delay or a date in the past is 0, a
    delay over :data:`~outbox.outcomes.LONGEST_RETRY_AFTER` is that. A header that is
    neither (several values, free text, an impossible date) is ignored: a malformed
    hint must not fail the call whose outcome it came with.
    """
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        seconds = min(max(float(value), 0.0), LONGEST_RETRY_AFTER.total_seconds())
        return timedelta(seconds=seconds)
    until = _http_date(value)
    if until is None:
        return None
    # Measured against the provider's own clock when it sent one: our clock may be off
    # from it by more than the wait it asks for.
    now = _http_date(response.headers.get("Date", "")) or datetime.now(UTC)
    return min(max(until - now, timedelta(0)), LONGEST_RETRY_AFTER)


def _http_date(value: str) -> datetime | None:
    try:
        moment = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    # "-0000" (or no zone) parses naive; HTTP dates are GMT.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def outcome_of_response(
    response: httpx.Response, *, in_flight_statuses: Collection[int] = (409,)
) -> None:
    """Return for a 2xx response; otherwise raise the signal the status means.

    - ``in_flight_statuses`` (409: the same idempotency key is being processed) ->
      ``InProgress("key_in_flight")``, an :class:`OutcomeUnknown`: the first request
      may still commit.
    - 429 -> ``RateLimited("rate_limited")``: the provider refused before doing
      anything and asks us to slow down.
    - 408, 5xx, and any non-2xx outside 4xx -> ``OutcomeUnknown("http_<status>")``.
    - other 4xx -> ``DefinitiveRejection`` with the body's error code, else
      ``"http_<status>"``.

    ``InProgress``, ``RateLimited`` and the 503's ``OutcomeUnknown`` carry the
    response's ``Retry-After`` (:func:`retry_after_of`) as ``retry_after``.
    """
    status = response.status_code
    if 200 <= status < 300:
        return
    if status in in_flight_statuses:
        raise InProgress("key_in_flight", retry_after=retry_after_of(response))
    if status == 429:
        raise RateLimited("rate_limited", retry_after=retry_after_of(response))
    if status == 408:
        # 408 claims the server never got the whole request, but proxies and load
        # balancers send it too, after forwarding. A lookup costs little; a second
        # effect is the failure this runtime exists to prevent.
        raise OutcomeUnknown("http_408")
    if 400 <= status < 500:
        raise DefinitiveRejection(error_code(response) or f"http_{status}")
    if status == 503:
        # Unavailable: the provider says when to come back; it may still have acted.
        raise OutcomeUnknown("http_503", retry_after=retry_after_of(response))
    # 5xx, and 3xx (redirects are not followed): the provider may have acted.
    raise OutcomeUnknown(f"http_{status}")


def response_json(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a successful response.

    The effect is confirmed but its body is unreadable, so the reference is missing:
    that is an unknown outcome for the lookup to settle, not a failure to retry.
    """
    body = _json_or_none(response)
    if not isinstance(body, dict):
        raise OutcomeUnknown("malformed_response")
    return body


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (ValueError, httpx.ResponseNotRead):
        # json.JSONDecodeError and UnicodeDecodeError are both ValueErrors.
        return None
