"""The provider breaker's decisions (outbox/breaker.py): when it opens, who probes, what
closes it, and what a call may do meanwhile."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.breaker import (
    GO,
    PROBE,
    BreakerRules,
    BreakerState,
    Failure,
    Hold,
    ProviderHealth,
    after_answer,
    after_failure,
    could_not_reach,
    take_probe,
    verdict,
)
from outbox.errors import ConfigurationError

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
RULES = BreakerRules(failures_to_open=3, window=timedelta(seconds=30))
FIXED = random.Random(0)


def fresh() -> ProviderHealth:
    return ProviderHealth(provider="payments")


def fail(
    health: ProviderHealth, at: datetime, operation: uuid.UUID | None = None, **failure: object
) -> ProviderHealth:
    return after_failure(
        health,
        Failure(operation or uuid.uuid4(), str(failure.pop("code", "http_503")), **failure),  # type: ignore[arg-type]
        now=at,
        rules=RULES,
        rng=FIXED,
    )


def opened() -> ProviderHealth:
    health = fresh()
    for second in range(3):
        health = fail(health, NOW + timedelta(seconds=second))
    return health


def test_failures_of_several_operations_in_a_row_open_it_with_the_streak_as_the_outage() -> None:
    health = fail(fresh(), NOW)
    health = fail(health, NOW + timedelta(seconds=1))
    assert health.state is BreakerState.CLOSED

    health = fail(health, NOW + timedelta(seconds=2))

    assert health.state is BreakerState.OPEN
    assert health.outage_started_at == NOW
    assert health.opened_at == NOW + timedelta(seconds=2)
    assert health.next_probe_at is not None
    assert NOW + timedelta(seconds=2.9) <= health.next_probe_at <= NOW + timedelta(seconds=3)


def test_one_operation_failing_over_and_over_says_nothing_about_the_provider() -> None:
    same = uuid.uuid4()
    health = fresh()
    for second in range(10):
        health = fail(health, NOW + timedelta(seconds=second), same)

    assert health.state is BreakerState.CLOSED
    assert health.failing_operations == (same,)


def test_failures_further_apart_than_the_window_start_a_new_streak() -> None:
    health = fail(fresh(), NOW)
    health = fail(health, NOW + timedelta(seconds=1))
    health = fail(health, NOW + timedelta(seconds=45))

    assert health.state is BreakerState.CLOSED
    assert len(health.failing_operations) == 1
    assert health.failing_since == NOW + timedelta(seconds=45)


def test_an_answer_forgets_the_streak_and_closes_an_open_breaker() -> None:
    streak = fail(fail(fresh(), NOW), NOW)
    assert not streak.clean

    assert after_answer(streak, now=NOW).clean
    closed = after_answer(opened(), now=NOW + timedelta(seconds=9))
    assert closed.clean
    assert closed.available
    assert closed.outage_started_at is None


def test_a_rate_limit_holds_calls_back_without_opening() -> None:
    health = fresh()
    for _ in range(5):
        health = fail(
            health, NOW, code="rate_limited", retry_after=timedelta(seconds=7), counts=False
        )

    assert health.state is BreakerState.CLOSED
    assert health.not_before == NOW + timedelta(seconds=7)
    assert verdict(health, now=NOW + timedelta(seconds=6)) == Hold(NOW + timedelta(seconds=7), None)
    assert verdict(health, now=NOW + timedelta(seconds=7)) is GO


def test_a_retry_after_survives_the_answer_that_closes_and_only_ever_grows() -> None:
    health = fail(opened(), NOW, retry_after=timedelta(seconds=30))
    health = fail(health, NOW, retry_after=timedelta(seconds=5))

    assert health.not_before == NOW + timedelta(seconds=30)
    assert after_answer(health, now=NOW).not_before == NOW + timedelta(seconds=30)


def test_one_probe_at_a_time_and_only_once_it_is_due() -> None:
    health = opened()
    assert health.next_probe_at is not None
    early = health.next_probe_at - timedelta(milliseconds=1)
    assert take_probe(health, owner="a", lease=timedelta(seconds=10), now=early) is None
    assert isinstance(verdict(health, now=early), Hold)
    assert verdict(health, now=health.next_probe_at) is PROBE

    probing = take_probe(health, owner="a", lease=timedelta(seconds=10), now=health.next_probe_at)

    assert probing is not None
    assert (probing.state, probing.probe_owner, probing.probes) == (BreakerState.HALF_OPEN, "a", 1)
    later = health.next_probe_at + timedelta(seconds=1)
    assert take_probe(probing, owner="b", lease=timedelta(seconds=10), now=later) is None
    assert verdict(probing, now=later) == Hold(probing.probe_expires_at, probing)  # type: ignore[arg-type]


def test_a_probe_whose_holder_went_silent_is_taken_over_when_its_lease_ends() -> None:
    health = opened()
    assert health.next_probe_at is not None
    probing = take_probe(health, owner="a", lease=timedelta(seconds=10), now=health.next_probe_at)
    assert probing is not None
    assert probing.probe_expires_at is not None

    taken = take_probe(
        probing, owner="b", lease=timedelta(seconds=10), now=probing.probe_expires_at
    )

    assert taken is not None
    assert (taken.probe_owner, taken.probes) == ("b", 2)


def test_only_the_probes_failure_reopens_and_each_one_waits_longer_up_to_the_longest() -> None:
    health = opened()
    pauses = []
    at = NOW
    for probe in range(8):
        assert health.next_probe_at is not None
        at = health.next_probe_at
        probing = take_probe(health, owner=f"p{probe}", lease=timedelta(seconds=5), now=at)
        assert probing is not None
        straggler = fail(probing, at, code="connection_lost")
        assert straggler.state is BreakerState.HALF_OPEN
        health = fail(probing, at, prober=f"p{probe}")
        assert health.state is BreakerState.OPEN
        assert health.probe_owner is None
        assert health.next_probe_at is not None
        pauses.append((health.next_probe_at - at).total_seconds())

    longest = RULES.longest_probe.total_seconds()
    assert pauses[:3] == sorted(pauses[:3])
    assert pauses[0] == pytest.approx(2 * 0.95, abs=0.11)
    assert all(0.9 * longest <= pause <= longest for pause in pauses[-3:])
    assert health.outage_started_at == NOW


def test_the_verdict_with_no_row_is_go() -> None:
    assert verdict(None, now=NOW) is GO
    assert verdict(fresh(), now=NOW) is GO


@pytest.mark.parametrize(
    ("code", "unreached"),
    [
        ("http_503", True),
        ("http_500", True),
        ("connect_failed", True),
        ("deadline_exceeded", True),
        ("lookup_timeout", True),
        ("provider_unreachable", True),
        ("http_404", False),
        ("http_429", False),
        ("lookup_inconclusive", False),
        ("malformed_response", False),
        ("tool_error", False),
        ("http_5033", False),
    ],
)
def test_which_codes_mean_no_answer_came(code: str, unreached: bool) -> None:
    assert could_not_reach(code) is unreached


def test_rules_that_could_never_tell_an_outage_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least 2 operations"):
        BreakerRules(failures_to_open=1)
    with pytest.raises(ConfigurationError, match="longest probe"):
        BreakerRules(first_probe=timedelta(seconds=5), longest_probe=timedelta(seconds=1))


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 120), st.booleans()), max_size=40))
def test_whatever_happens_the_row_keeps_the_tables_invariants(
    events: list[tuple[int, int, bool]],
) -> None:
    operations = [uuid.UUID(int=n + 1) for n in range(6)]
    health = fresh()
    for which, second, answered in events:
        at = NOW + timedelta(seconds=second)
        if answered:
            health = after_answer(health, now=at)
        else:
            taken = take_probe(health, owner="p", lease=timedelta(seconds=5), now=at)
            health = fail(taken or health, at, operations[which], prober="p" if taken else None)
        # The CHECKs of provider_health in schema.sql.
        assert (health.probe_owner is None) == (health.probe_expires_at is None)
        assert (health.state is BreakerState.HALF_OPEN) == (health.probe_owner is not None)
        assert (health.state is BreakerState.CLOSED) == (health.outage_started_at is None)
        assert len(health.failing_operations) <= 100
