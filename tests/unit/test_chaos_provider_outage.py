"""The chaos run's provider outage and rate limit (#44): how the schedule draws them,
what each does to the sandbox and when it ends, and how they keep out of the faults that
need the provider. The sandbox is not started (its faults are set in this process) and
no daemon runs, so no service is needed."""

from __future__ import annotations

import time

import pytest

from harness.chaos import build_parser
from harness.faults import FAULT_CATEGORIES, FAULTS
from harness.parameters import (
    FAULT_RETRY_AFTER_STREAM_SECONDS,
    OUTAGE_TOLERANCE_SECONDS,
    PROVIDER_FAULT_SECONDS,
    PROVIDER_OUTAGE_SECONDS,
    RATE_LIMIT_EVERY,
    RATE_LIMIT_RETRY_AFTER_SECONDS,
    outage_tolerances,
)
from harness.run import Chaos
from harness.schedule import ScheduledFault, fault_schedule
from outbox.sandbox.provider import SandboxProvider

from support.chaos_runs import idle_chaos

EVERYTHING = frozenset(FAULT_CATEGORIES)


def outages(schedule: list[ScheduledFault]) -> list[ScheduledFault]:
    return [fault for fault in schedule if fault.kind == "provider_outage"]


def test_the_provider_category_takes_in_the_outage_and_the_rate_limit() -> None:
    assert {"provider_outage", "provider_rate_limit"} <= set(FAULT_CATEGORIES["provider"])


@pytest.mark.parametrize("operations", [150, 300, 5000])
def test_every_schedule_has_exactly_one_outage_of_a_drawn_length(operations: int) -> None:
    for seed in range(20):
        [outage] = outages(fault_schedule(seed, operations, EVERYTHING))
        assert outage.seconds == PROVIDER_OUTAGE_SECONDS[outage.slot]


def test_the_seed_draws_each_outage_length_and_always_the_same_one() -> None:
    drawn = {seed: outages(fault_schedule(seed, 300, EVERYTHING))[0].seconds for seed in range(40)}

    assert set(drawn.values()) == set(PROVIDER_OUTAGE_SECONDS)
    assert all(
        outages(fault_schedule(seed, 300, EVERYTHING))[0].seconds == drawn[seed]
        for seed in range(40)
    )


def test_a_configured_outage_length_keeps_the_rest_of_the_schedule() -> None:
    drawn = fault_schedule(7, 300, EVERYTHING)
    fixed = fault_schedule(7, 300, EVERYTHING, outage_seconds=12.5)

    assert [fault.seconds for fault in outages(fixed)] == [12.5]
    assert [(f.at, f.kind, f.slot) for f in fixed] == [(f.at, f.kind, f.slot) for f in drawn]


@pytest.mark.parametrize("seed", range(30))
def test_the_outage_comes_after_every_kill_in_effect(seed: int) -> None:
    schedule = fault_schedule(seed, 300, EVERYTHING)
    [outage] = outages(schedule)

    kills = [fault.at for fault in schedule if fault.kind == "consumer_kill_in_effect"]

    assert kills
    assert all(at <= outage.at for at in kills)


def test_the_schedule_says_how_long_each_outage_lasts() -> None:
    fault = ScheduledFault(3.0, "provider_outage", 1, 60.0)

    assert fault.describe().endswith("503 to every call and lookup for 60 s")
    limit = ScheduledFault(3.0, "provider_rate_limit", 0).target()
    assert f"Retry-After: {RATE_LIMIT_RETRY_AFTER_SECONDS}" in limit


def test_the_outage_length_flag_takes_positive_seconds_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    assert parser.parse_args([]).provider_outage_seconds is None
    assert parser.parse_args(["--provider-outage-seconds", "5"]).provider_outage_seconds == 5.0
    for bad in ("0", "-5", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--provider-outage-seconds", bad])
        assert "is not a positive number of seconds" in capsys.readouterr().err


def test_the_refund_tool_waits_longer_than_a_minute_and_less_than_five() -> None:
    # One outage to be waited out, one that ends with a person (harness/checker.py).
    assert PROVIDER_OUTAGE_SECONDS[1] < OUTAGE_TOLERANCE_SECONDS < PROVIDER_OUTAGE_SECONDS[2]
    tolerances = outage_tolerances()
    assert tolerances["send_refund"].total_seconds() == OUTAGE_TOLERANCE_SECONDS
    assert {"send_email", "get_refund"} <= set(tolerances)


@pytest.fixture
def chaos() -> Chaos:
    # A provider never started: set_faults acts on its books alone.
    return idle_chaos(provider=SandboxProvider(), stream_start=time.monotonic())


def end_now(chaos: Chaos, kind: str) -> None:
    ends_at, end, _ = chaos.endings.pop(kind)
    assert ends_at > time.monotonic()
    end()


def test_an_outage_takes_the_provider_down_for_its_length_then_brings_it_back(
    chaos: Chaos,
) -> None:
    before = time.monotonic()
    assert FAULTS["provider_outage"].inject(chaos, ScheduledFault(1.0, "provider_outage", 1, 60.0))

    assert chaos.provider.faults.unavailable
    assert chaos.tally.provider_outages == 1
    ends_at = chaos.endings["provider_outage"][0]
    assert before + 60.0 <= ends_at <= time.monotonic() + 60.0

    end_now(chaos, "provider_outage")

    assert not chaos.provider.faults.unavailable
    assert chaos.provider_back is not None
    [(start, end)] = chaos.outage_spans
    assert before <= start <= end <= chaos.provider_back


def test_a_lookups_outage_counts_as_an_outage_for_the_checker(chaos: Chaos) -> None:
    FAULTS["lookups_unavailable"].inject(chaos, ScheduledFault(1.0, "lookups_unavailable", 0))
    end_now(chaos, "lookups_unavailable")

    assert len(chaos.outage_spans) == 1
    # Only a whole outage moves the point recovery from an overload is judged from.
    assert chaos.provider_back is None


def test_a_rate_limit_window_asks_for_retry_after_then_ends(chaos: Chaos) -> None:
    assert FAULTS["provider_rate_limit"].inject(
        chaos, ScheduledFault(1.0, "provider_rate_limit", 0)
    )

    faults = chaos.provider.faults
    assert (faults.rate_limit_every, faults.rate_limit_retry_after_s) == (
        RATE_LIMIT_EVERY,
        RATE_LIMIT_RETRY_AFTER_SECONDS,
    )
    assert chaos.endings["provider_rate_limit"][0] <= time.monotonic() + PROVIDER_FAULT_SECONDS
    assert chaos.tally.rate_limit_windows == 1

    end_now(chaos, "provider_rate_limit")

    assert chaos.provider.faults.rate_limit_every == 0
    assert chaos.outage_spans == []


def test_a_kill_in_effect_waits_for_the_provider_to_be_back(chaos: Chaos) -> None:
    kill = ScheduledFault(2.0, "consumer_kill_in_effect", 0)
    assert not chaos._waits_its_turn(kill)

    FAULTS["provider_outage"].inject(chaos, ScheduledFault(1.0, "provider_outage", 0, 5.0))

    # Postponed, not tried (a try would count toward giving up), and if tried it declines.
    assert chaos._waits_its_turn(kill)
    assert not FAULTS["consumer_kill_in_effect"].inject(chaos, kill)
    end_now(chaos, "provider_outage")
    assert not chaos._waits_its_turn(kill)


def test_faults_that_need_work_keep_their_tries_while_the_provider_is_down(
    chaos: Chaos,
) -> None:
    chaos.retry_until = 0.0
    FAULTS["provider_outage"].inject(chaos, ScheduledFault(1.0, "provider_outage", 2, 300.0))
    later = chaos.stream_start + 200.0

    chaos._tend(later)

    # Refunds waiting for the provider are work in flight again once it is back.
    assert chaos.retry_until == pytest.approx(200.0 + FAULT_RETRY_AFTER_STREAM_SECONDS)
    assert "provider_outage" in chaos.endings
