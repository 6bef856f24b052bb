"""A provider's health and limits, with the consumer in process and tools that record
when each call started (#44): a declared rate shared by two consumers, a Retry-After no
call breaks, a 409 "same key in flight" that waits, and a contract written before any of
this (its lookups answering StillUnknown on a 503) that waits out an outage unchanged."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from outbox import (
    EffectResult,
    ExecutionContext,
    Found,
    InProgress,
    NotFound,
    OutcomeUnknown,
    ProviderLimits,
    ProviderUnavailable,
    RateLimited,
    Registry,
    RetryPolicy,
    Settings,
    SideEffect,
    StillUnknown,
    ToolContract,
    Unreachable,
    record_decision,
    store,
)
from outbox.errors import ContractRefused
from outbox.outcomes import Reconciliation

from support.consume_helpers import operation, running_consumer
from support.dispatch_helpers import running_dispatcher
from support.sample_tools import RefundInput
from support.waiting import eventually

REFUND = {"payment_id": "pay_1", "amount_cents": 1250}
RETRY = RetryPolicy(
    max_attempts=3,
    initial_backoff=timedelta(milliseconds=50),
    max_backoff=timedelta(milliseconds=200),
    reconcile_max_attempts=3,
)


@dataclass
class Provider:
    """A provider that records when each call started, and fails as told."""

    started: list[float] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    slow: float = 0.0
    """Seconds each refund takes."""
    refunds: dict[str, int] = field(default_factory=dict)
    down: bool = False
    broken: bool = False
    """The tool itself fails (a bug of its own), whatever the provider would say."""
    refusing: bool = False
    """Down, and the tool says so: ProviderUnavailable for calls, Unreachable for lookups."""
    answers: list[str] = field(default_factory=list)
    """Consumed one per call: "429" (Retry-After 1.5 s) or "409"."""
    lookups: int = 0

    async def refund(self, refund: RefundInput, ctx: ExecutionContext) -> EffectResult:
        self.started.append(time.monotonic())
        if self.broken:
            raise RuntimeError("the tool's own bug")
        if self.refusing:
            raise ProviderUnavailable("http_503")
        if self.down:
            # How a contract written before the breaker reads a 503 from outbox.http.
            raise OutcomeUnknown("http_503")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.slow:
                await asyncio.sleep(self.slow)  # the provider's own time to answer
        finally:
            self.in_flight -= 1
        answer = self.answers.pop(0) if self.answers else None
        if answer == "429":
            raise RateLimited(retry_after=1.5)
        if answer == "409":
            raise InProgress(retry_after=0.3)
        self.refunds[ctx.idempotency_key] = self.refunds.get(ctx.idempotency_key, 0) + 1
        return EffectResult(provider_reference=f"re_{ctx.idempotency_key[:8]}")

    async def find(self, refund: RefundInput, ctx: ExecutionContext) -> Reconciliation:
        self.lookups += 1
        if self.broken:
            raise RuntimeError("the tool's own bug")
        if self.refusing:
            return Unreachable("http_503")
        if self.down:
            return StillUnknown("http_503")
        if ctx.idempotency_key in self.refunds:
            return Found(provider_reference=f"re_{ctx.idempotency_key[:8]}")
        return NotFound()


def registry_for(tools: Provider, **contract: Any) -> Registry:
    registry = Registry()
    registry.register(
        ToolContract(
            name="send_refund",
            version=1,
            input_model=RefundInput,
            side_effect=SideEffect.DEDUPLICATED_WRITE,
            execute=tools.refund,
            reconcile=tools.find,
            dedupe_window=timedelta(hours=24),
            retry=RETRY,
            deadline=timedelta(seconds=2),
            **contract,
        )
    )
    return registry


def decide_many(database_url: str, registry: Registry, count: int) -> list[Any]:
    with psycopg.connect(database_url) as connection:
        recorded = [
            record_decision(
                connection,
                registry,
                "send_refund",
                {**REFUND, "payment_id": f"pay_{n}"},
                run_id="run",
            ).operation
            for n in range(count)
        ]
        connection.commit()
    return recorded


def committed(database_url: str, count: int) -> Any:
    async def check() -> bool:
        def count_committed() -> int:
            with psycopg.connect(database_url) as connection:
                row = connection.execute(
                    "SELECT count(*) FROM operations WHERE state = 'committed'"
                ).fetchone()
                return int(row[0]) if row else 0

        return await asyncio.to_thread(count_committed) == count

    return check


def rows(database_url: str, sql: str) -> list[dict[str, Any]]:
    with psycopg.connect(database_url, row_factory=dict_row) as connection:
        return connection.execute(sql).fetchall()


@pytest.fixture
def fast(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"reconcile_interval": 0.05, "lease_margin": 1.0, "provider_health_refresh": 0.2}
    )


async def test_a_declared_rate_is_shared_by_every_consumer(
    fast: Settings, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = Provider()
    limits = ProviderLimits(calls_per_second=8, burst=2)
    registry = registry_for(provider, provider_limits=limits)
    decisions = decide_many(database_url, registry, 24)
    # When the first turn was asked for: before its statement is sent, so no earlier than
    # the database booked it, however late the machine then runs the call itself.
    asked: list[float] = []
    book = store.book_provider_call

    def book_and_note(*args: Any, **kwargs: Any) -> Any:
        asked.append(time.monotonic())
        return book(*args, **kwargs)

    monkeypatch.setattr(store, "book_provider_call", book_and_note)

    async with (
        running_dispatcher(fast),
        running_consumer(fast, registry),
        running_consumer(fast, registry),
    ):
        await eventually(committed(database_url, 24), within=30, what="every refund")

    starts = sorted(provider.started)
    assert limits.interval is not None
    interval = limits.interval.total_seconds()
    # Every turn is booked after the first was asked for, and the k-th turn is at least
    # k - burst + 1 intervals after the first booking: the k-th call to start starts no
    # earlier than that, however late any call ran (without the limit, all 24 calls start
    # within a fraction of a second of the first turn asked for). 5 ms for the timers.
    first_asked = min(asked)
    for k, start in enumerate(starts):
        assert start - first_asked >= (k - limits.burst + 1) * interval - 0.005, k
    assert len(starts) == 24
    assert all(provider.refunds[str(op.id)] == 1 for op in decisions)


async def test_calls_at_once_stay_within_the_declared_limit_across_consumers(
    fast: Settings, database_url: str
) -> None:
    provider = Provider(slow=0.3)
    limits = ProviderLimits(concurrent_calls=2)
    registry = registry_for(provider, provider_limits=limits)
    decisions = decide_many(database_url, registry, 12)

    async with (
        running_dispatcher(fast),
        running_consumer(fast, registry),
        running_consumer(fast, registry),
    ):
        await eventually(committed(database_url, 12), within=60, what="every refund")

    # Both consumers run in this process and call the same provider object, so its count
    # of calls in flight is the count across consumers.
    assert provider.most_in_flight == 2
    assert all(provider.refunds[str(op.id)] == 1 for op in decisions)
    assert rows(database_url, "SELECT * FROM provider_calls") == []  # every place given back


async def test_no_call_goes_out_before_a_retry_after_expires(
    fast: Settings, database_url: str
) -> None:
    provider = Provider(answers=["429"])
    registry = registry_for(provider)
    decisions = decide_many(database_url, registry, 6)

    async with running_dispatcher(fast), running_consumer(fast, registry):
        await eventually(committed(database_url, 6), within=30, what="every refund")

    first = min(provider.started)
    # Calls that started within a few milliseconds of the refused one were on their way
    # before it was refused; every later call waited out its 1.5 s.
    later = [start for start in provider.started if start - first > 0.05]
    assert later
    assert min(later) - first >= 1.5
    assert len(provider.started) == 7
    finals = [operation(database_url, op.id) for op in decisions]
    assert max(final.attempts for final in finals) == 1  # the 429 cost nothing
    assert [row["name"] for row in rows(database_url, "SELECT name FROM provider_events")] == []


async def test_a_key_in_flight_waits_and_sends_the_same_key_again_at_no_cost(
    fast: Settings, database_url: str
) -> None:
    provider = Provider(answers=["409", "409"])
    registry = registry_for(provider)
    (decision,) = decide_many(database_url, registry, 1)

    async with running_dispatcher(fast), running_consumer(fast, registry):
        await eventually(committed(database_url, 1), within=30, what="the refund")

    final = operation(database_url, decision.id)
    assert (final.attempts, final.reconcile_attempts, final.waiting_since) == (1, 0, None)
    assert len(provider.started) == 3
    assert provider.refunds == {str(decision.id): 1}
    assert provider.started[1] - provider.started[0] >= 0.3


@pytest.mark.timeout(120)
async def test_a_contract_written_before_the_breaker_waits_out_an_outage(
    fast: Settings, database_url: str
) -> None:
    provider = Provider(down=True)
    registry = registry_for(provider)  # StillUnknown("http_503") lookups, no limits
    decisions = decide_many(database_url, registry, 8)

    async with running_dispatcher(fast), running_consumer(fast, registry):

        async def opened() -> bool:
            found = await asyncio.to_thread(rows, database_url, "SELECT state FROM provider_health")
            return [row["state"] for row in found] == ["open"]

        await eventually(opened, within=30, what="the breaker to open")
        lookups_when_open = provider.lookups
        calls_when_open = len(provider.started)
        # Longer than the contract's lookups (3) and attempts (3) would have lasted.
        await asyncio.sleep(8)  # the outage itself, not a wait for a condition
        probes = len(provider.started) + provider.lookups - calls_when_open - lookups_when_open
        states = {operation(database_url, op.id).state for op in decisions}
        provider.down = False
        await eventually(committed(database_url, 8), within=30, what="every refund")

    assert "escalated" not in states
    assert 1 <= probes <= 8  # one probe at a time, seconds apart
    finals = [operation(database_url, op.id) for op in decisions]
    assert all(final.reconcile_attempts <= 1 for final in finals)
    assert all(provider.refunds[str(op.id)] == 1 for op in decisions)
    events = rows(database_url, "SELECT name FROM provider_events ORDER BY id")
    assert [row["name"] for row in events] == ["provider.unavailable", "provider.available"]


def test_one_provider_with_two_declared_rates_is_refused() -> None:
    provider = Provider()
    registry = registry_for(provider, provider="payments", provider_limits=ProviderLimits(5))
    other = ToolContract(
        name="get_refund",
        version=1,
        input_model=RefundInput,
        side_effect=SideEffect.READ_ONLY,
        execute=provider.refund,
        provider="payments",
        provider_limits=ProviderLimits(50),
    )

    with pytest.raises(ContractRefused, match="declared with other limits"):
        registry.register(other)
    assert ("get_refund", 1) not in registry


@pytest.mark.parametrize(
    ("limits", "problem"),
    [
        ({"calls_per_second": 0}, "calls_per_second must be"),
        ({"calls_per_second": float("inf")}, "calls_per_second must be"),
        ({"calls_per_second": 5, "burst": 0}, "burst must be"),
        ({"concurrent_calls": 0}, "concurrent_calls must be"),
        ({}, "declare calls_per_second, concurrent_calls or both"),
    ],
)
def test_limits_that_mean_nothing_are_refused(limits: dict[str, Any], problem: str) -> None:
    with pytest.raises(ContractRefused, match=problem):
        ProviderLimits(**limits)


@pytest.mark.timeout(120)
async def test_a_tool_that_fails_on_its_own_says_nothing_of_its_provider(
    fast: Settings, database_url: str
) -> None:
    # Refused calls leave every operation prepared, so each probe is an attempt.
    provider = Provider(refusing=True)
    registry = registry_for(provider)
    decide_many(database_url, registry, 6)

    async def breaker() -> list[str]:
        found = await asyncio.to_thread(rows, database_url, "SELECT state FROM provider_health")
        return [str(row["state"]) for row in found]

    async with running_dispatcher(fast), running_consumer(fast, registry):

        async def opened() -> bool:
            return await breaker() == ["open"]

        await eventually(opened, within=30, what="the breaker to open")
        provider.refusing, provider.broken = False, True
        calls = len(provider.started) + provider.lookups

        async def probed_by_the_broken_tool() -> bool:
            return len(provider.started) + provider.lookups >= calls + 2

        await eventually(probed_by_the_broken_tool, within=40, what="two probes to go out")
        still = await breaker()
        provider.broken = False
        await eventually(committed(database_url, 6), within=40, what="every refund")

    # Its probes raised: neither an answer that closes the breaker nor a failure of the
    # provider's; only the provider's own answer closed it.
    assert still in (["open"], ["half_open"])
    events = rows(database_url, "SELECT name FROM provider_events ORDER BY id")
    assert [row["name"] for row in events] == ["provider.unavailable", "provider.available"]
