"""The outbox command's front: what a newcomer types first."""

from __future__ import annotations

import argparse

import pytest

from outbox.cli import (
    EXIT_CONFIGURATION,
    build_parser,
    positive_int,
    positive_int_up_to,
    positive_seconds,
    run_command,
    settings_from,
)
from outbox.metrics import version


def test_a_bare_outbox_shows_its_commands_instead_of_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_command([]) == 0
    shown = capsys.readouterr()
    assert "COMMAND" in shown.out
    assert "migrate" in shown.out
    assert "error" not in shown.err


def test_version_names_the_installed_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run_command(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"outbox {version()}"


def test_a_duration_flags_default_is_shown_in_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    # It read "7 days, 0:00:00", which the flag does not take.
    with pytest.raises(SystemExit):
        run_command(["dispatcher", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "[env OUTBOX_RETENTION; default 604800 s]" in text
    assert "days," not in text


def test_demo_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    # It printed the module's docstring: ``double backticks`` and :func: roles.
    with pytest.raises(SystemExit):
        run_command(["demo", "--help"])
    description = capsys.readouterr().out.split("\n\n")[1]
    assert description.startswith("Watch a lost refund response, twice")
    assert "``" not in description
    assert ":func:" not in description
    assert ":data:" not in description


# Every command that loads tools modules, as a user types it.
TOOLS_COMMANDS = [
    ["consumer"],
    ["contracts"],
    ["mcp"],
    ["console"],
    ["callbacks", "serve"],
]


@pytest.mark.parametrize("command", TOOLS_COMMANDS, ids=" ".join)
def test_tools_means_one_thing_in_every_command(
    command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was two behaviours: a setting joined from every use, or a list read by hand.
    monkeypatch.setenv("OUTBOX_TOOLS", "from.the.variable")
    parser = build_parser()
    given = settings_from(parser.parse_args([*command, "--tools", "a.b", "--tools", "c.d,e.f"]))
    assert given.tools == "a.b,c.d,e.f"
    assert settings_from(parser.parse_args(command)).tools == "from.the.variable"


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5"])
def test_a_count_is_a_whole_number_from_one(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive_int(text)


def test_a_bounded_count_names_its_bounds() -> None:
    up_to_four = positive_int_up_to(4)
    assert [up_to_four(text) for text in ("1", "4")] == [1, 4]
    for text in ("0", "5"):
        with pytest.raises(argparse.ArgumentTypeError, match="between 1 and 4"):
            up_to_four(text)


@pytest.mark.parametrize("text", ["0", "0.0001", "-1", "3601", "nan", "inf", "soon"])
def test_a_lock_wait_must_end(text: str) -> None:
    # A lock_timeout of 0 is Postgres's "wait forever": what --lock-timeout is there to stop.
    with pytest.raises(argparse.ArgumentTypeError):
        positive_seconds(text)


def test_migrate_takes_a_lock_wait_in_seconds_and_a_number_of_tries() -> None:
    arguments = build_parser().parse_args(
        ["migrate", "--lock-timeout", "0.25", "--lock-tries", "3"]
    )
    assert (arguments.lock_timeout, arguments.lock_tries) == (0.25, 3)
    defaults = build_parser().parse_args(["migrate"])
    assert (defaults.lock_timeout, defaults.lock_tries) == (1.0, 10)


def test_a_configuration_refusal_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_TOOLS", "")
    assert run_command(["contracts"]) == EXIT_CONFIGURATION
    assert (
        "outbox contracts: configuration error: no tools modules given" in capsys.readouterr().err
    )
