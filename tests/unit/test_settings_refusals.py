"""Settings that cannot be meant are refused before anything starts: an ``OUTBOX_*``
name nobody reads (a typo that would leave the default in force), a duration of zero or
less than a millisecond, and combinations that undo the lease's protection."""

from __future__ import annotations

import os
import re
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from outbox.errors import ConfigurationError
from outbox.settings import (
    ENV_PREFIX,
    OTHER_VARIABLES,
    Settings,
    known_variables,
    load_settings,
    settings_in,
)

REPOSITORY = Path(__file__).resolve().parents[2]
CANARY = "pw-CANARY-5b7e"
# The names these tests (and the docs' example) make up on purpose: the only OUTBOX_*
# names anywhere in the repository that are not variables someone reads.
MADE_UP = {
    "OUTBOX_LEASE_MARGN",
    "OUTBOX_DATABSE_URL",
    "OUTBOX_RECONCILE_INTERVALL",
    "OUTBOX_MY_SERVICE_COLOUR",
}


@pytest.fixture(autouse=True)
def clean_outbox_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test run's own OUTBOX_* variables are known ones; each test sets what it needs.
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


# --- names ---------------------------------------------------------------------------


def test_a_mistyped_variable_is_refused_naming_the_nearest_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_LEASE_MARGN", "5")

    with pytest.raises(ConfigurationError) as refused:
        load_settings()

    assert str(refused.value) == (
        "OUTBOX_LEASE_MARGN is not a setting; did you mean OUTBOX_LEASE_MARGIN?"
    )


def test_a_mistyped_secret_is_named_and_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABSE_URL", f"postgresql://app:{CANARY}@db/ops")
    monkeypatch.setenv("outbox_reconcile_intervall", "0.5")  # read without case, as pydantic does

    with pytest.raises(ConfigurationError) as refused:
        load_settings()

    message = str(refused.value)
    assert "OUTBOX_DATABSE_URL is not a setting; did you mean OUTBOX_DATABASE_URL?" in message
    assert (
        "outbox_reconcile_intervall is not a setting; did you mean OUTBOX_RECONCILE_INTERVAL?"
        in message
    )
    assert CANARY not in message
    assert len(message.splitlines()) == 1


def test_a_name_like_no_setting_says_the_prefix_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_MY_SERVICE_COLOUR", "blue")

    with pytest.raises(ConfigurationError) as refused:
        load_settings()

    assert str(refused.value).startswith("OUTBOX_MY_SERVICE_COLOUR is not a setting of ")
    assert "give a variable of your own another prefix" in str(refused.value)
    assert "blue" not in str(refused.value)


def test_every_variable_the_project_reads_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTHER_VARIABLES:
        monkeypatch.setenv(name, "1")

    assert load_settings() == Settings()


def test_a_childs_environment_reads_back_without_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon's children get ``{**os.environ, **settings.to_environment()}``."""
    settings = Settings(lease_margin=20.0, db_transaction_timeout=12.5, tools="x")
    monkeypatch.setenv("OUTBOX_TEST_DATABASE_URL", "postgresql://ci/x")
    for name, value in settings.to_environment().items():
        monkeypatch.setenv(name, value)

    assert load_settings() == settings
    assert set(settings.to_environment()) <= known_variables()


_VARIABLE = re.compile(r"\bOUTBOX_[A-Z0-9_]*[A-Z0-9]\b")
_SCANNED = ("*.py", "*.md", "*.yaml", "*.yml", "*.toml", "*.sh", "*.json", "Dockerfile", "run")


def test_every_outbox_variable_named_in_the_repository_is_known() -> None:
    """Code, tests, CI, benchmarks, deployment files and docs: a name added anywhere
    must be added to OTHER_VARIABLES too, or every command would refuse it."""
    named: dict[str, Path] = {}
    for pattern in _SCANNED:
        for path in REPOSITORY.rglob(pattern):
            if {".venv", ".git", "node_modules"} & set(path.relative_to(REPOSITORY).parts):
                continue
            for name in _VARIABLE.findall(path.read_text(errors="replace")):
                named.setdefault(name, path.relative_to(REPOSITORY))

    unknown = {name: str(path) for name, path in named.items() if name not in known_variables()}
    assert set(unknown) == MADE_UP, unknown
    assert {"OUTBOX_TEST_DATABASE_URL", "OUTBOX_TEST_REQUIRE_RABBITMQCTL"} <= set(named)


# --- durations -----------------------------------------------------------------------


def _duration_fields() -> set[str]:
    durations = {float, timedelta}
    return {
        name
        for name, field in Settings.model_fields.items()
        if set(typing.get_args(field.annotation) or (field.annotation,)) & durations
    }


def test_every_duration_setting_is_audited() -> None:
    assert set(settings_in("duration")) == _duration_fields()


def test_the_groups_are_read_from_the_fields_in_declaration_order() -> None:
    assert settings_in("broker") == (
        "amqp_url",
        "exchange",
        "queue",
        "dead_letter_exchange",
        "dead_letter_queue",
        "delivery_limit",
        "tool_queues",
    )
    assert set(settings_in("lease_bounded")) <= set(settings_in("database_bound"))
    assert set(settings_in("lease_bounded")) <= set(settings_in("duration"))
    with pytest.raises(ValueError, match="no setting group 'brokers'"):
        settings_in("brokers")


def _seconds(name: str, value: float) -> Any:
    if Settings.model_fields[name].annotation is timedelta:
        return timedelta(seconds=value)
    return value


def _no_waits() -> list[tuple[str, float]]:
    cases = []
    for name in sorted(_duration_fields()):
        finite = Settings.model_fields[name].annotation is timedelta  # always finite
        for value in [0.0, -1.0, 1e-6, *([] if finite else [float("inf"), float("nan")])]:
            cases.append((name, value))
    return cases


@pytest.mark.parametrize(("name", "value"), _no_waits())
def test_a_duration_that_is_no_wait_is_refused(name: str, value: float) -> None:
    variable = f"{ENV_PREFIX}{name.upper()}"

    with pytest.raises(ConfigurationError) as refused:
        load_settings(**{name: _seconds(name, value)})

    message = str(refused.value)
    assert message.startswith(f"invalid settings: {variable}: ")
    assert "0.001 or more" in message
    assert "Value error" not in message


def test_the_environment_spelling_of_a_zero_duration_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_RETENTION", "PT0S")
    monkeypatch.setenv("OUTBOX_RECONCILE_INTERVAL", "0.000001")

    with pytest.raises(ConfigurationError) as refused:
        load_settings()

    assert "OUTBOX_RETENTION: " in str(refused.value)
    assert "OUTBOX_RECONCILE_INTERVAL: 1e-06 s" in str(refused.value)


def test_a_millisecond_is_the_shortest_duration_accepted() -> None:
    settings = Settings(
        reconcile_interval=0.001,
        poll_interval=0.001,
        retention=timedelta(milliseconds=1),
        lease_margin=0.002,
        db_transaction_timeout=0.001,
    )

    assert settings.reconcile_interval == 0.001


# --- combinations --------------------------------------------------------------------


@pytest.mark.parametrize(
    "bound",
    [
        "db_transaction_timeout",
        "db_statement_timeout",
        "db_lock_timeout",
        "db_idle_in_transaction_timeout",
    ],
)
@pytest.mark.parametrize("seconds", [5.0, 0.5])
def test_a_session_bound_the_lease_margin_does_not_outlast_is_refused(
    bound: str, seconds: float
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_settings(lease_margin=0.5, **{bound: seconds})

    message = str(refused.value)
    variable = f"OUTBOX_{bound.upper()}"
    assert message.startswith("invalid settings: OUTBOX_LEASE_MARGIN (0.5 s) must be longer ")
    assert f"than {variable} ({seconds:g} s)" in message
    assert f"raise OUTBOX_LEASE_MARGIN above {seconds:g} s or lower {variable} below 0.5 s" in (
        message
    )


def test_a_bound_that_is_unset_derives_from_the_margin_and_passes() -> None:
    settings = Settings(lease_margin=0.5)

    assert settings.db_transaction_timeout is None


def test_a_longest_retry_wait_shorter_than_the_first_is_refused() -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_settings(publish_retry_initial=2.0, publish_retry_max=1.0)

    assert str(refused.value) == (
        "invalid settings: OUTBOX_PUBLISH_RETRY_MAX (1 s) is shorter than "
        "OUTBOX_PUBLISH_RETRY_INITIAL (2 s), the first wait before a publish is retried: "
        "raise OUTBOX_PUBLISH_RETRY_MAX to 2 s or more, or lower OUTBOX_PUBLISH_RETRY_INITIAL"
    )


def test_settings_built_in_code_are_refused_alike() -> None:
    with pytest.raises(ValidationError, match="OUTBOX_LEASE_MARGIN"):
        Settings(lease_margin=1.0, db_transaction_timeout=2.0)
    with pytest.raises(ValidationError, match="reconcile_interval"):
        Settings(reconcile_interval=0)
    with pytest.raises(ValidationError, match="database_url"):
        Settings(database_url=SecretStr("mysql://x/y"))


def test_the_defaults_are_possible() -> None:
    assert load_settings() == Settings()
