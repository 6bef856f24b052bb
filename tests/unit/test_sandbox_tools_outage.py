"""The example tools against the sandbox's outage and rate limit (#44), over real HTTP:
what each answer becomes. The sandbox runs in this process; no services are needed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest

from outbox.outcomes import (
    ExecutionContext,
    OutcomeUnknown,
    ProviderUnavailable,
    RateLimited,
    Unreachable,
)
from outbox.sandbox import tools
from outbox.sandbox.provider import SandboxProvider
from outbox.sandbox.tools import EmailInput, RefundInput, RefundLookup

REFUND = RefundInput(payment_id="pay_outage1", amount_cents=1250)
EMAIL = EmailInput(to="ada@example.com", subject="Your refund", body="On its way.")


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[SandboxProvider]:
    with SandboxProvider() as running:
        monkeypatch.setenv(tools.SANDBOX_URL_ENV, running.url)
        yield running


def context() -> ExecutionContext:
    return ExecutionContext(operation_id=uuid.uuid4(), attempt=1, deadline=time.monotonic() + 10)


async def test_in_an_outage_a_call_waits_for_the_provider_and_a_lookup_is_unreachable(
    provider: SandboxProvider,
) -> None:
    provider.set_faults(unavailable=True, unavailable_retry_after_s=2)

    # The outage's 503 "service_unavailable" comes before the sandbox reads anything:
    # nothing was done, so every write waits for the provider, an email included, with
    # the provider's hint on when to come back.
    with pytest.raises(ProviderUnavailable) as refund:
        await tools.send_refund(REFUND, context())
    assert (refund.value.code, refund.value.retry_after) == (
        "service_unavailable",
        timedelta(seconds=2),
    )
    with pytest.raises(ProviderUnavailable) as email:
        await tools.send_email(EMAIL, context())
    assert email.value.code == "service_unavailable"
    with pytest.raises(ProviderUnavailable):
        await tools.get_refund(RefundLookup(refund_id="re_1"), context())
    # The lookup could not ask: it costs none of the contract's lookups.
    assert await tools.find_refund(REFUND, context()) == Unreachable(
        "http_503", retry_after=timedelta(seconds=2)
    )
    assert provider.ledger()["totals"] == {"refunds": 0, "emails": 0}


async def test_any_other_503_stays_an_unknown_outcome(provider: SandboxProvider) -> None:
    # The fail-before-commit fault answers 503 "unavailable": a real provider's 503 can
    # come after it acted, and a tool cannot tell, so only the outage's own code waits.
    provider.set_faults(fail_before_commit_every=1)

    with pytest.raises(OutcomeUnknown) as refund:
        await tools.send_refund(REFUND, context())
    assert refund.value.code == "http_503"
    with pytest.raises(OutcomeUnknown) as email:
        await tools.send_email(EMAIL, context())
    assert email.value.code == "http_503"


def test_every_sandbox_tool_shares_one_provider() -> None:
    # One breaker for the sandbox: an email's failed calls count toward the refunds'
    # outage and the other way round, as for tools of one payment service.
    assert {contract.provider for contract in tools.build_registry()} == {"sandbox"}


async def test_lookups_unavailable_alone_is_unreachable_too(provider: SandboxProvider) -> None:
    provider.set_faults(lookups_unavailable=True)

    assert await tools.find_refund(REFUND, context()) == Unreachable("http_503")


async def test_a_rate_limit_is_rate_limited_with_its_retry_after(
    provider: SandboxProvider,
) -> None:
    provider.set_faults(rate_limit_every=1, rate_limit_retry_after_s=3)

    with pytest.raises(RateLimited) as refund:
        await tools.send_refund(REFUND, context())
    assert refund.value.retry_after == timedelta(seconds=3)
    with pytest.raises(RateLimited):
        await tools.send_email(EMAIL, context())
    assert await tools.find_refund(REFUND, context()) == Unreachable(
        "rate_limited", retry_after=timedelta(seconds=3)
    )
    assert provider.ledger()["totals"] == {"refunds": 0, "emails": 0}
