"""Third-party libraries log at WARNING at the least, and without tracebacks: what they
would print at INFO (httpx: every request URL) or in a traceback (exception messages,
frames) may hold user data or credentials. And the lines go to stderr as it is when they
are written, not as it was when logging was configured."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import pytest

from outbox.logs import THIRD_PARTY_LOGGERS, configure_logging

CANARY = "canary-4b1d2e"


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in THIRD_PARTY_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, saved in levels.items():
        logging.getLogger(name).setLevel(saved)


@pytest.mark.parametrize("level", ["DEBUG", "INFO"])
def test_a_request_url_logged_by_httpx_never_reaches_the_log(
    capsys: pytest.CaptureFixture[str], level: str
) -> None:
    configure_logging(level)

    logging.getLogger("httpx").info(
        'HTTP Request: POST https://api.example/refunds?key=%s "HTTP/1.1 201"', CANARY
    )
    logging.getLogger("outbox.test").info("own line")

    err = capsys.readouterr().err
    assert CANARY not in err
    assert "own line" in err


def test_a_third_party_traceback_becomes_one_line_with_the_error_type(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("INFO")

    try:
        raise ConnectionResetError(f"peer reset while sending {CANARY}")
    except ConnectionResetError:
        logging.getLogger("aiormq.connection").exception("Unexpected connection close")

    err = capsys.readouterr().err
    assert CANARY not in err
    assert "Traceback" not in err
    assert "Unexpected connection close error=ConnectionResetError" in err
    assert len(err.strip().splitlines()) == 1


def test_the_runtime_keeps_its_own_tracebacks(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO")

    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("consumer.worker").exception("consumer.crashed")

    assert "Traceback" in capsys.readouterr().err


def test_lines_go_to_stderr_as_it_is_when_they_are_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configured_on = io.StringIO()
    monkeypatch.setattr(sys, "stderr", configured_on)
    configure_logging("INFO")
    # What a test runner does between tests, or a wrapper that redirects stderr.
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    configured_on.close()

    logging.getLogger("outbox.test").info("after the swap")

    written = now.getvalue()
    assert "after the swap" in written
    assert "Logging error" not in written
