"""Example tools against the payment sandbox (:mod:`outbox.sandbox.provider`).

``send_refund`` is a deduplicated write with a lookup, ``get_refund`` a read, and
``send_email`` a non-repeatable write that nobody can look up: its provider's delivery
callback settles an unknown outcome, and without one a person checks it. The lookup
tells a provider it could not ask (:class:`~outbox.outcomes.Unreachable`: the runtime
waits for the provider and spends no lookup) from one that answered without deciding
(:class:`~outbox.outcomes.StillUnknown`). Both writes declare the sandbox's signed
webhooks (:mod:`outbox.sandbox.webhooks`). Run them with
``outbox consumer --tools outbox.sandbox.tools`` and read
their cards with ``outbox contracts --tools outbox.sandbox.tools``.

The sandbox's address comes from ``OUTBOX_SANDBOX_URL`` (default
``http://127.0.0.1:8600``), read on every call so that tests and operators can point
an already imported module elsewhere.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

from outbox.breaker import could_not_reach
from outbox.callback_policy import CallbackPolicy
from outbox.contracts import (
    ApprovalPolicy,
    OnUnknown,
    Registry,
    RetryPolicy,
    SideEffect,
    ToolContract,
)
from outbox.http import (
    error_code,
    http_outcomes,
    outcome_of_response,
    response_json,
    retry_after_of,
)
from outbox.outcomes import (
    DefinitiveRejection,
    EffectResult,
    EffectSignal,
    ExecutionContext,
    Found,
    NotFound,
    NotSent,
    OutcomeUnknown,
    ProviderUnavailable,
    RateLimited,
    Reconciliation,
    StillUnknown,
    Unreachable,
)
from outbox.sandbox.webhooks import EMAIL, PAYMENTS

SANDBOX_URL_ENV = "OUTBOX_SANDBOX_URL"
DEFAULT_SANDBOX_URL = "http://127.0.0.1:8600"


def sandbox_url() -> str:
    return os.environ.get(SANDBOX_URL_ENV) or DEFAULT_SANDBOX_URL


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verification (certifi's CA certificates, or ``SSL_CERT_FILE``),
    built once: each client built without one loads the certificates again, 52 ms of CPU
    on a two-core host, most of what a sandbox refund cost the consumer."""
    return httpx.create_ssl_context()


def _default_client() -> httpx.AsyncClient:
    # One client per call: nothing is shared across event loops or worker threads, and
    # a connection never outlives the attempt that opened it. Only the TLS context, which
    # holds no connection, is shared.
    return httpx.AsyncClient(base_url=sandbox_url(), verify=_tls_context())


_client_factory: Callable[[], httpx.AsyncClient] = _default_client
"""The seam tests replace with a client on an ``httpx.MockTransport``."""


class RefundInput(BaseModel):
    # Strict, like every input here: lax validation took True for an amount of 1 cent
    # and "100" for 100. An agent's input is recorded as sent, or refused.
    model_config = ConfigDict(strict=True)

    payment_id: str = Field(pattern=r"^pay_[A-Za-z0-9_]{1,60}$")
    amount_cents: int = Field(gt=0)
    currency: str = Field(default="EUR", pattern=r"^[A-Z]{3}$")
    reason: str = Field(default="", max_length=500)


class RefundLookup(BaseModel):
    model_config = ConfigDict(strict=True)

    # The id goes into the URL path: the pattern keeps "/", "?" and ".." out of it.
    refund_id: str = Field(pattern=r"^re_[A-Za-z0-9_]{1,60}$")


class EmailInput(BaseModel):
    model_config = ConfigDict(strict=True)

    to: str = Field(pattern=r"^[^@\s]+@[^@\s]+\.[^@\s]+$", max_length=254)
    subject: str = Field(max_length=200)
    body: str = Field(max_length=20_000)


def _timeout(ctx: ExecutionContext) -> float:
    remaining = ctx.remaining()
    if remaining <= 0:
        # Nothing was sent yet; httpx would treat 0 as "no wait" with varying results.
        raise NotSent("deadline_passed")
    return remaining


SANDBOX_PROVIDER = "sandbox"
"""The one provider behind every sandbox tool: a refund's failures and an email's open the
same breaker, as one payment service's would."""


def _refused_while_down(response: httpx.Response) -> None:
    # The sandbox's outage answers 503 "service_unavailable" before it reads the request,
    # so nothing was done: the attempt waits for the provider instead of asking a lookup,
    # or a person for an email. Any other 503 (the fail-before-commit fault's
    # "unavailable") stays an unknown outcome, as a real provider's would.
    if response.status_code == 503 and error_code(response) == "service_unavailable":
        raise ProviderUnavailable("service_unavailable", retry_after=retry_after_of(response))


async def send_refund(refund: RefundInput, ctx: ExecutionContext) -> EffectResult:
    """POST /refunds with the operation id as the idempotency key."""
    timeout = _timeout(ctx)
    async with http_outcomes(), _client_factory() as client:
        response = await client.post(
            "/refunds",
            json=refund.model_dump(),
            headers={"Idempotency-Key": ctx.idempotency_key},
            timeout=timeout,
        )
    if response.status_code == 422 and error_code(response) == "idempotency_key_reused":
        # This key already names a request with other parameters, and that one may have
        # refunded. "Rejected" could send the agent off to refund again; the lookup by
        # key tells what this key actually did.
        raise OutcomeUnknown("idempotency_key_reused")
    _refused_while_down(response)
    outcome_of_response(response)
    reference, result = _evidence(response_json(response))
    return EffectResult(provider_reference=reference, result=result)


async def find_refund(refund: RefundInput, ctx: ExecutionContext) -> Reconciliation:
    """GET /refunds?idempotency_key=: Found, NotFound only on the provider's explicit
    "not_found", Unreachable when the provider could not be asked (no connection, no
    answer, 408, 429 or 5xx: it said nothing about the refund, so the lookup costs none
    of the contract's budget and the runtime waits for the provider), StillUnknown for
    any other answer."""
    try:
        timeout = _timeout(ctx)
        async with http_outcomes(), _client_factory() as client:
            response = await client.get(
                "/refunds", params={"idempotency_key": ctx.idempotency_key}, timeout=timeout
            )
    except EffectSignal as failed:
        return _inconclusive(failed)
    if response.status_code == 200:
        try:
            reference, result = _evidence(response_json(response))
        except OutcomeUnknown as malformed:
            return StillUnknown(malformed.code)
        return Found(provider_reference=reference, result=result)
    if response.status_code == 404 and error_code(response) == "not_found":
        # NotFound lets even a write whose key was pruned go again: only the lookup
        # endpoint's own answer proves absence, never a bare 404 from a wrong route.
        return NotFound()
    try:
        outcome_of_response(response)
    except EffectSignal as inconclusive:
        return _inconclusive(inconclusive)
    return StillUnknown(f"http_{response.status_code}")


def _inconclusive(signal: EffectSignal) -> Unreachable | StillUnknown:
    # "in progress" (409), an unreadable body or a stray 4xx is the provider answering
    # without deciding; a rate limit or a code could_not_reach knows is no answer at all.
    if isinstance(signal, RateLimited) or could_not_reach(signal.code):
        return Unreachable(signal.code, retry_after=signal.retry_after)
    return StillUnknown(signal.code)


async def get_refund(lookup: RefundLookup, ctx: ExecutionContext) -> EffectResult:
    """GET /refunds/<id>."""
    timeout = _timeout(ctx)
    async with http_outcomes(), _client_factory() as client:
        response = await client.get(f"/refunds/{lookup.refund_id}", timeout=timeout)
    if response.status_code == 404:
        raise DefinitiveRejection("refund_not_found")
    _refused_while_down(response)
    outcome_of_response(response)
    body = response_json(response)
    reference, result = _evidence(body)
    details = {
        name: body[name]
        for name in ("payment_id", "amount_cents", "currency")
        if isinstance(body.get(name), str | int)
    }
    return EffectResult(provider_reference=reference, result={**result, **details})


async def send_email(email: EmailInput, ctx: ExecutionContext) -> EffectResult:
    """POST /emails. The provider takes no idempotency key and offers no lookup; it echoes
    the X-Reference header in its delivery webhook, which is how that names the
    operation."""
    timeout = _timeout(ctx)
    async with http_outcomes(), _client_factory() as client:
        response = await client.post(
            "/emails",
            json=email.model_dump(),
            headers={"X-Reference": ctx.idempotency_key},
            timeout=timeout,
        )
    _refused_while_down(response)
    outcome_of_response(response)
    reference, result = _evidence(response_json(response))
    return EffectResult(provider_reference=reference, result=result)


def _evidence(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The provider reference and status of a refund or email body.

    A 2xx without an id confirms an effect without the evidence to record it: that is
    an unknown outcome for the lookup (or a person) to settle, never a success.
    """
    reference = body.get("id")
    if not isinstance(reference, str) or not reference:
        raise OutcomeUnknown("malformed_response")
    status = body.get("status")
    return reference, ({"status": status} if isinstance(status, str) else {})


REFUND_DEADLINE_ENV = "OUTBOX_SANDBOX_REFUND_DEADLINE"
CALLBACK_WAIT_ENV = "OUTBOX_SANDBOX_CALLBACK_WAIT"
OUTAGE_TOLERANCE_ENV = "OUTBOX_SANDBOX_OUTAGE_TOLERANCE"
DEFAULT_CALLBACK_WAIT_SECONDS = 60.0


def build_registry() -> Registry:
    # The demo shortens the refund deadline (OUTBOX_SANDBOX_REFUND_DEADLINE, seconds) so
    # that a slow answer becomes a timeout within seconds, and tests that expect an
    # unknown email at a person at once set the wait for its callback
    # (OUTBOX_SANDBOX_CALLBACK_WAIT, seconds) to 0.
    refund_deadline = float(os.environ.get(REFUND_DEADLINE_ENV, "5"))
    callback_wait = timedelta(
        seconds=float(os.environ.get(CALLBACK_WAIT_ENV, str(DEFAULT_CALLBACK_WAIT_SECONDS)))
    )
    # A refund waits for the sandbox this long before a person is asked (seconds;
    # OUTBOX_SANDBOX_OUTAGE_TOLERANCE): 15 minutes, as a payment would say; tests that
    # outlast it shorten it.
    outage_tolerance = timedelta(seconds=float(os.environ.get(OUTAGE_TOLERANCE_ENV, "900")))
    registry = Registry()
    registry.register(
        ToolContract(
            name="send_refund",
            version=1,
            provider=SANDBOX_PROVIDER,
            input_model=RefundInput,
            side_effect=SideEffect.DEDUPLICATED_WRITE,
            execute=send_refund,
            reconcile=find_refund,
            dedupe_window=timedelta(hours=24),
            retry=RetryPolicy(
                max_attempts=5,
                initial_backoff=timedelta(milliseconds=200),
                max_backoff=timedelta(seconds=5),
                reconcile_max_attempts=5,
            ),
            approval=ApprovalPolicy.above("amount_cents", 50_000),
            deadline=timedelta(seconds=refund_deadline),
            # The sandbox's refund.succeeded is signed and names the key: as good as the
            # lookup's Found. Its refund.failed only says a request was declined; the
            # lookup, not the callback, proves a refund absent.
            callbacks=CallbackPolicy(PAYMENTS, settles_unknown=True),
            outage_tolerance=outage_tolerance,
            description="Refund amount_cents of a card payment to the customer, at most "
            "once per operation, through the payment sandbox.",
        )
    )
    registry.register(
        ToolContract(
            name="get_refund",
            version=1,
            provider=SANDBOX_PROVIDER,
            input_model=RefundLookup,
            side_effect=SideEffect.READ_ONLY,
            execute=get_refund,
            retry=RetryPolicy(
                max_attempts=3,
                initial_backoff=timedelta(milliseconds=200),
                max_backoff=timedelta(seconds=2),
            ),
            deadline=timedelta(seconds=5),
            description="Read a refund's status from the payment sandbox; changes nothing.",
        )
    )
    registry.register(
        ToolContract(
            name="send_email",
            version=1,
            provider=SANDBOX_PROVIDER,
            input_model=EmailInput,
            side_effect=SideEffect.NON_REPEATABLE_WRITE,
            execute=send_email,
            on_unknown=OnUnknown.ESCALATE,
            retry=RetryPolicy(
                max_attempts=3,
                initial_backoff=timedelta(milliseconds=500),
                max_backoff=timedelta(seconds=10),
            ),
            deadline=timedelta(seconds=10),
            # The provider's delivery webhook is the only evidence an email has: an unknown
            # outcome waits for it, and it settles the outcome instead of a person.
            callbacks=CallbackPolicy(EMAIL, settles_unknown=True, wait=callback_wait),
            description="Send one email to a customer. It cannot be looked up: its delivery "
            "callback settles an unknown outcome, and without one a person checks, instead "
            "of a second email going out.",
        )
    )
    return registry


registry = build_registry()
