"""How many deliveries a consumer's burst of claims or of outcomes takes at once."""

from __future__ import annotations

import pytest

from consumer.database import MOST_BURST_OPERATIONS, Database
from outbox.pacing import AIMDLimit
from outbox.settings import Settings

URL = "postgresql://nobody@127.0.0.1:1/never"


def database(**settings: int) -> Database:
    return Database(Settings(database_url=URL, **settings))  # type: ignore[arg-type]


def test_a_burst_of_chunks_takes_what_is_in_hand_up_to_the_bound() -> None:
    assert database(prefetch=64, message_operations=16).burst_limit() == MOST_BURST_OPERATIONS
    assert database(prefetch=4, message_operations=16).burst_limit() == 64
    assert database(prefetch=3, message_operations=5).burst_limit() == 15


@pytest.mark.parametrize("prefetch", [1, 64, 300, 1000])
def test_one_operation_per_message_keeps_the_prefetch_as_the_burst(prefetch: int) -> None:
    assert database(prefetch=prefetch, message_operations=1).burst_limit() == prefetch


def test_a_limit_above_the_bound_is_never_cut_below_itself() -> None:
    assert database(prefetch=300, message_operations=16).burst_limit() == 300


def test_a_narrowed_limit_narrows_the_bursts() -> None:
    narrowing = database(prefetch=64, message_operations=16)
    narrowing.pacing = AIMDLimit(most=64, cooldown=0)
    seen = [narrowing.burst_limit()]
    while narrowing.pacing.overloaded():
        seen.append(narrowing.burst_limit())
    assert seen == [256, 256, 256, 128, 64, 32, 16]
    assert narrowing.pacing.limit == 1
