"""The bound on an agent's decision waiting for a lock: a setting, 5 s by default, and
the caller's session keeps its own lock_timeout (issue #49, item 4)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox import (
    ConfigurationError,
    DecisionBlocked,
    RecordedDecision,
    Registry,
    record_decision,
    record_decision_async,
)
from outbox.bounds import DECISION_LOCK_TIMEOUT
from outbox.settings import Settings


def decide(
    connection: psycopg.Connection[Any], registry: Registry, key: str, **options: Any
) -> RecordedDecision:
    return record_decision(
        connection,
        registry,
        "send_refund",
        {"payment_id": "p_lock", "amount_cents": 1},
        run_id="r_lock",
        decision_key=key,
        **options,
    )


def recorded(database_url: str, key: str) -> int:
    with psycopg.connect(database_url) as connection:
        row = connection.execute(
            "SELECT count(*) FROM operations WHERE decision_key = %s", (key,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_decision_gives_up_after_the_lock_timeout_it_is_given(
    database_url: str, registry: Registry
) -> None:
    # The bound was fixed at 5 s in the schema: a caller could neither shorten nor
    # lengthen it.
    with psycopg.connect(database_url) as analyst:
        analyst.execute("LOCK TABLE operations IN SHARE ROW EXCLUSIVE MODE")
        with (
            psycopg.connect(database_url, options="-c statement_timeout=20000") as connection,
            pytest.raises(DecisionBlocked, match=r"waited 0\.2 s for a lock .* same decision key"),
        ):
            decide(connection, registry, "k_short", lock_timeout=0.2)
    assert recorded(database_url, "k_short") == 0


async def test_the_async_decision_takes_the_same_bound(
    database_url: str, registry: Registry
) -> None:
    with psycopg.connect(database_url) as analyst:
        analyst.execute("LOCK TABLE operations IN SHARE ROW EXCLUSIVE MODE")
        async with await psycopg.AsyncConnection.connect(database_url) as connection:
            with pytest.raises(DecisionBlocked, match=r"waited 0\.1 s"):
                await record_decision_async(
                    connection,
                    registry,
                    "send_refund",
                    {"payment_id": "p_lock", "amount_cents": 1},
                    run_id="r_lock",
                    decision_key="k_async",
                    lock_timeout=0.1,
                )
    assert recorded(database_url, "k_async") == 0


def test_the_callers_session_keeps_its_own_lock_timeout(
    database_url: str, registry: Registry
) -> None:
    with psycopg.connect(database_url) as connection:
        connection.execute("SET lock_timeout = '7s'")
        decide(connection, registry, "k_keeps", lock_timeout=1)
        shown = connection.execute("SHOW lock_timeout").fetchone()
    assert shown == ("7s",)
    assert recorded(database_url, "k_keeps") == 1


@pytest.mark.parametrize("seconds", [0, -1, 0.0001, 60.5, float("nan")])
def test_a_lock_timeout_out_of_bounds_is_refused_and_writes_nothing(
    database_url: str, registry: Registry, seconds: float
) -> None:
    with (
        psycopg.connect(database_url) as connection,
        pytest.raises(
            ConfigurationError, match=r"a decision's lock timeout is 0\.001 to 60 seconds"
        ),
    ):
        decide(connection, registry, "k_refused", lock_timeout=seconds)
    assert recorded(database_url, "k_refused") == 0


def test_the_database_refuses_a_bound_out_of_range_from_any_caller(database_url: str) -> None:
    # A caller that reaches the function without the library meets the same bound.
    with (
        psycopg.connect(database_url) as connection,
        pytest.raises(psycopg.errors.InvalidParameterValue, match="1 to 60000 ms"),
    ):
        connection.execute(
            "SELECT id FROM outbox_record_decision(gen_random_uuid(), 'r', 'k', 'send_refund', "
            "1, 'idempotent_write', '{}'::jsonb, repeat('a', 64), false, '{}'::jsonb, 0)"
        )


def test_the_setting_defaults_to_five_seconds_and_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().decision_lock_timeout == DECISION_LOCK_TIMEOUT == 5.0
    monkeypatch.setenv("OUTBOX_DECISION_LOCK_TIMEOUT", "2.5")
    assert Settings().decision_lock_timeout == 2.5
    monkeypatch.setenv("OUTBOX_DECISION_LOCK_TIMEOUT", "61")
    with pytest.raises(ValueError, match="decision_lock_timeout"):
        Settings()
