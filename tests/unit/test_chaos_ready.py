"""The chaos run's first decision waits until its daemons say they are healthy. Beside a
sweep's CPU hogs and fsync writers they took over 10 s to start: the stream met no
consumer, the quiet phase answered almost nothing, and recovery was judged against the
offered rate instead of a rate the machine had shown it could reach."""

from __future__ import annotations

import http.server
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.daemons import Daemon
from harness.rabbit_node import free_port
from harness.run import Chaos
from outbox.sandbox.processes import DaemonProcess

from support.chaos_runs import idle_chaos

DEADLINE_SECONDS = 30.0


class Health(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[Health]]]:
    handler = type("ThisHealth", (Health,), {"status": 503})
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield port, handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def running_process() -> Iterator[DaemonProcess]:
    # Stands in for a daemon's process: alive until killed.
    process = DaemonProcess([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        yield process
    finally:
        process.kill()


def test_healthy_is_what_healthz_answers_while_the_process_runs(
    health_server: tuple[int, type[Health]], running_process: DaemonProcess
) -> None:
    port, handler = health_server
    daemon = Daemon("consumer", 0, {}, Path("."), metrics_port=port, process=running_process)

    assert not daemon.healthy(), "503 is not healthy"
    handler.status = 200
    assert daemon.healthy()
    running_process.kill()
    assert not daemon.healthy(), "a process that exited is not healthy, whoever holds its port"


def test_a_port_nobody_listens_on_is_not_healthy(running_process: DaemonProcess) -> None:
    daemon = Daemon("consumer", 0, {}, Path("."), metrics_port=free_port())
    daemon.process = running_process

    assert not daemon.healthy()


class Starting:
    """A daemon that turns healthy after ``polls`` questions."""

    def __init__(self, name: str, polls: int) -> None:
        self.name = name
        self.polls = polls
        self.asked = 0

    def healthy(self) -> bool:
        self.asked += 1
        return self.asked > self.polls


def chaos_with(daemons: list[Starting]) -> Chaos:
    return idle_chaos(daemons=daemons)


def test_the_stream_waits_until_every_daemon_is_healthy() -> None:
    daemons = [Starting("dispatcher#0", 0), Starting("consumer#0", 3), Starting("consumer#1", 5)]
    chaos = chaos_with(daemons)

    chaos._await_ready(time.monotonic() + DEADLINE_SECONDS)

    assert [daemon.asked for daemon in daemons] == [1, 4, 6], "asked until healthy, no longer"


def test_a_daemon_never_healthy_is_named_and_the_stream_starts_anyway(
    capsys: pytest.CaptureFixture[str],
) -> None:
    never = Starting("consumer#1", 10**9)
    chaos = chaos_with([Starting("dispatcher#0", 0), never])

    chaos._await_ready(time.monotonic() + 0.5)

    printed = capsys.readouterr().out
    assert "not healthy" in printed
    assert "consumer#1" in printed
    assert "dispatcher#0" not in printed
