"""DaemonProcess: a child's output kept, its lines awaited, and SIGTERM then SIGKILL."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from outbox.sandbox.processes import DaemonNotReady, DaemonProcess, python_module, stop_all

# A stand-in daemon: says it is ready, then runs until a signal ends it (SIGTERM at once,
# with a last line, unless told to ignore it).
DAEMON = """
import signal, sys
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    def stop(signum, frame):
        print("stopping on", signal.Signals(signum).name, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
print("starting", flush=True)
print("ready to work", file=sys.stderr, flush=True)
while True:
    signal.pause()  # idle: the SIGTERM handler exits; ignoring it, only SIGKILL ends this
"""


def stand_in(*args: str) -> list[str]:
    return [sys.executable, "-c", DAEMON, *args]


def test_a_captured_daemon_is_awaited_by_line_and_stopped_with_sigterm() -> None:
    with DaemonProcess(stand_in(), capture=True, name="stand-in") as daemon:
        line = daemon.wait_for_line("ready", within=20)

        assert line == "ready to work\n"  # stderr is captured with stdout
        assert daemon.running()
        assert daemon.returncode is None
        assert daemon.stop(timeout=20) == 0

    assert daemon.lines == ["starting\n", "ready to work\n", "stopping on SIGTERM\n"]
    assert daemon.tail(1) == "stopping on SIGTERM"
    assert not daemon.running()


def test_a_daemon_that_ignores_sigterm_is_killed_past_the_deadline() -> None:
    daemon = DaemonProcess(stand_in("--ignore-term"), capture=True)
    daemon.wait_for_line("ready", within=20)

    began = time.monotonic()
    code = daemon.stop(timeout=0.5)

    assert code == -signal.SIGKILL
    assert time.monotonic() - began < 10


def test_a_paused_daemon_still_stops_on_sigterm() -> None:
    daemon = DaemonProcess(stand_in(), capture=True)
    daemon.wait_for_line("ready", within=20)
    daemon.signal(signal.SIGSTOP)

    assert daemon.stop(timeout=20) == 0  # continued first, then it acted on SIGTERM
    assert "stopping on SIGTERM" in daemon.output()


def test_a_logged_daemon_writes_its_file_and_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    daemon = DaemonProcess(stand_in(), log=log)
    daemon.wait_for_line("ready", within=20)

    assert daemon.pid > 0
    assert daemon.kill() == -signal.SIGKILL
    assert log.read_text() == "starting\nready to work\n"
    assert daemon.output() == log.read_text()


def test_stop_all_sends_sigterm_to_every_daemon_first() -> None:
    daemons = [DaemonProcess(stand_in(), capture=True) for _ in range(3)]
    for daemon in daemons:
        daemon.wait_for_line("ready", within=20)

    stop_all(daemons, timeout=20)

    assert [daemon.returncode for daemon in daemons] == [0, 0, 0]


def test_a_daemon_that_exits_before_its_line_is_reported_with_its_last_lines() -> None:
    command = [sys.executable, "-c", "import sys; print('no config'); sys.exit(2)"]
    daemon = DaemonProcess(command, capture=True, name="broken")

    with pytest.raises(DaemonNotReady, match=r"broken exited with status 2") as refused:
        daemon.wait_for_line("ready", within=20)

    assert "no config" in str(refused.value)


def test_a_line_that_never_comes_is_awaited_no_longer_than_asked() -> None:
    with DaemonProcess(stand_in(), capture=True, name="quiet") as daemon:
        began = time.monotonic()
        with pytest.raises(DaemonNotReady, match=r"quiet did not write 'never' within 0.3 s"):
            daemon.wait_for_line("never", within=0.3)

        assert time.monotonic() - began < 5


def test_python_module_runs_a_module_on_this_interpreter() -> None:
    assert python_module("dispatcher", "--once") == [sys.executable, "-m", "dispatcher", "--once"]
    with DaemonProcess(python_module("json.tool", "--help"), capture=True) as daemon:
        assert daemon.wait(20) == 0

    assert daemon.name == "json.tool"
    assert "usage" in daemon.output()
