"""Settings.to_environment: what a child process is given reads back as the same settings."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr

from outbox.settings import ENV_PREFIX, MIN_SECONDS, Settings


def read_back(environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as a child process given exactly ``environment`` reads them."""
    with monkeypatch.context() as scope:
        # The test run's own OUTBOX_* variables must not fill in what the environment lacks.
        for name in list(os.environ):
            if name.upper().startswith(ENV_PREFIX):
                scope.delenv(name)
        for name, value in environment.items():
            scope.setenv(name, value)
        return Settings()


def test_settings_survive_the_trip_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(
        database_url=SecretStr("postgresql://agent:p%40ss%20w%23rd@db.internal:6432/outbox"),
        amqp_url=SecretStr("amqps://user:s3cret@broker.internal:5671/vhost?heartbeat=7"),
        queue="run.abc.operations",
        poll_interval=0.1 + 0.2,  # 0.30000000000000004: no digit may be lost
        publish_timeout=2.5e16,  # written with an exponent: it must read back the same
        retention=timedelta(days=3, hours=4, seconds=5, microseconds=6),
        requeue_stale_after=timedelta(seconds=10),
        db_lock_timeout=2.5,
        db_statement_timeout=None,
        metrics_port=None,
        log_level="DEBUG",
        log_format="json",
        declare_topology=True,
    )

    environment = settings.to_environment()

    assert read_back(environment, monkeypatch) == settings


def test_the_variables_are_named_and_written_as_an_operator_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(
        amqp_url=SecretStr("amqp://guest:s3cret@127.0.0.1:5672/"),
        declare_topology=True,
        requeue_stale_after=timedelta(seconds=10),
        metrics_port=0,
        db_lock_timeout=None,
    )

    environment = settings.to_environment()

    assert environment["OUTBOX_AMQP_URL"] == "amqp://guest:s3cret@127.0.0.1:5672/"
    assert environment["OUTBOX_DECLARE_TOPOLOGY"] == "true"
    assert environment["OUTBOX_REQUEUE_STALE_AFTER"] == "PT10S"
    assert environment["OUTBOX_METRICS_PORT"] == "0"
    assert environment["OUTBOX_LOG_LEVEL"] == "INFO"
    # None is what an unset variable reads as: the variable is left out.
    assert "OUTBOX_DB_LOCK_TIMEOUT" not in environment
    assert set(environment) == {
        f"{ENV_PREFIX}{name.upper()}"
        for name in Settings.model_fields
        if getattr(settings, name) is not None
    }
    assert Settings(declare_topology=False).to_environment()["OUTBOX_DECLARE_TOPOLOGY"] == "false"


def test_the_defaults_survive_the_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = read_back({}, monkeypatch)

    assert read_back(defaults.to_environment(), monkeypatch) == defaults


@given(
    interval=st.floats(min_value=MIN_SECONDS, max_value=1e9, allow_nan=False, allow_infinity=False),
    retention=st.timedeltas(
        min_value=timedelta(seconds=MIN_SECONDS), max_value=timedelta(days=9999)
    ),
)
def test_any_float_and_any_duration_survive_the_trip(interval: float, retention: timedelta) -> None:
    settings = Settings(poll_interval=interval, retention=retention)

    with pytest.MonkeyPatch.context() as monkeypatch:
        assert read_back(settings.to_environment(), monkeypatch) == settings


@pytest.mark.parametrize("name", ["retention", "requeue_stale_after", "approval_denial_grace"])
def test_a_timedelta_setting_takes_seconds_as_its_docs_say(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "3600" was refused as a malformed ISO 8601 duration.
    variable = f"{ENV_PREFIX}{name.upper()}"
    assert getattr(read_back({variable: "3600"}, monkeypatch), name) == timedelta(hours=1)
    assert getattr(read_back({variable: "PT1H"}, monkeypatch), name) == timedelta(hours=1)
    assert getattr(Settings.model_validate({name: "90.5"}), name) == timedelta(seconds=90.5)
