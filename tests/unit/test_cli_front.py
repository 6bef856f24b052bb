"""The outbox command's front: what a newcomer types first."""

from __future__ import annotations

import pytest

from outbox.cli import run_command
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
