"""Daemons as child processes, for ``outbox demo``, the chaos harness, the benchmarks and
the tests.

A :class:`DaemonProcess` keeps what the daemon writes (in a file, or in memory line by
line) so that its caller can wait for a line or show why it died, and stops it as an
orchestrator would: SIGTERM, then SIGKILL past a deadline.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

# What a daemon gets to finish the work in its hands after SIGTERM.
STOP_SECONDS = 15.0
# After SIGKILL only the kernel has work left; longer than this means something is wrong.
KILL_WAIT_SECONDS = 30.0
# How often a log file is read again while a line is awaited (captured output wakes the
# waiter as each line arrives).
POLL_SECONDS = 0.05
# What is left to read of a pipe once its writer has exited.
DRAIN_SECONDS = 10.0


def python_module(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` as ``python -m`` does, on this interpreter."""
    return [sys.executable, "-m", module, *args]


class DaemonNotReady(RuntimeError):
    """The daemon exited, or did not write the awaited line in time."""


class DaemonProcess:
    """``command`` running as a child process, started at once.

    Its stdout and stderr both go to ``log`` (a file, truncated first), or with
    ``capture`` into :attr:`lines`; otherwise they are this process's own. Its stdin is
    empty: no daemon reads one, and none may take the terminal's.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        environment: Mapping[str, str] | None = None,
        log: Path | None = None,
        capture: bool = False,
        cwd: Path | None = None,
        name: str | None = None,
    ) -> None:
        if log is not None and capture:
            raise ValueError("a daemon's output goes to a log file or into memory, not both")
        self.name = name or _name_of(command)
        self.log = log
        self._lines: list[str] = []
        self._arrived = threading.Condition()
        self._reader: threading.Thread | None = None
        self._terminated = False
        # The commands are this project's own (its modules, its benchmarks' scripts).
        if log is not None:
            # The child writes through a descriptor of its own: ours can close at once.
            with log.open("wb") as file:
                self._process = subprocess.Popen(  # noqa: S603
                    command,
                    env=environment,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=file,
                    stderr=subprocess.STDOUT,
                )
        elif capture:
            self._process = subprocess.Popen(  # noqa: S603
                command,
                env=environment,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            # Read as it comes: a full pipe would block the daemon, and a caller may wait
            # for a line while it runs.
            self._reader = threading.Thread(
                target=self._read, name=f"{self.name} output", daemon=True
            )
            self._reader.start()
        else:
            self._process = subprocess.Popen(  # noqa: S603
                command, env=environment, cwd=cwd, stdin=subprocess.DEVNULL
            )

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the daemon has exited (minus the signal that ended it),
        else None."""
        return self._process.poll()

    def running(self) -> bool:
        return self.returncode is None

    def signal(self, signum: int) -> None:
        """Send ``signum``, unless the daemon has exited (and its pid may be another's)."""
        self._process.send_signal(signum)

    def terminate(self) -> None:
        """SIGTERM, without waiting for the exit (:meth:`stop` waits). A paused daemon
        (SIGSTOP) is continued first: it cannot act on SIGTERM while stopped."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        self._terminated = True

    def wait(self, timeout: float) -> int:
        """The exit status; ``subprocess.TimeoutExpired`` if it has not come within
        ``timeout`` seconds."""
        return self._process.wait(timeout)

    def stop(self, timeout: float = STOP_SECONDS) -> int:
        """SIGTERM, then SIGKILL if the daemon has not exited within ``timeout`` seconds;
        its exit status."""
        if self.running():
            if not self._terminated:
                # Once only: a second SIGTERM tells a daemon to drop the work in its hands.
                self.terminate()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(KILL_WAIT_SECONDS)
        return self._finish()

    def kill(self) -> int:
        """SIGKILL (which ends a paused daemon too), and wait for the exit; its status."""
        self._process.kill()
        self._process.wait(KILL_WAIT_SECONDS)
        return self._finish()

    @property
    def lines(self) -> list[str]:
        """What the daemon wrote so far, line by line, each with its line end."""
        # Split at "\n" only: a log line may carry a \r or a U+2028 of its own.
        parts = self._written().split("\n")
        return [f"{part}\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])

    def output(self) -> str:
        """What the daemon wrote so far; all of it once it has exited."""
        return self._written()

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines the daemon wrote."""
        return "\n".join(self._written().splitlines()[-lines:])

    def _written(self) -> str:
        if self.log is not None:
            try:
                return self.log.read_text(errors="replace")
            except FileNotFoundError:
                return ""
        if self._reader is not None and not self.running():
            self._reader.join(DRAIN_SECONDS)
        with self._arrived:
            return "".join(self._lines)

    def wait_for_line(self, marker: str, within: float = 20.0) -> str:
        """The first line that contains ``marker``, as soon as the daemon has written it;
        :class:`DaemonNotReady` (with the daemon's last lines) if it exits first or has
        not written it within ``within`` seconds."""
        if self.log is None and self._reader is None:
            raise ValueError(f"{self.name}'s output is neither logged nor captured")
        deadline = time.monotonic() + within
        while True:
            exited = not self.running()
            # Read after the exit is seen, so that its last lines are in.
            found = next((line for line in self.lines if marker in line), None)
            if found is not None:
                return found
            if exited:
                raise DaemonNotReady(
                    f"{self.name} exited with status {self.returncode} before writing "
                    f"{marker!r}; its last lines:\n{self.tail()}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonNotReady(
                    f"{self.name} did not write {marker!r} within {within:g} s; its last "
                    f"lines:\n{self.tail()}"
                )
            self._await_output(min(left, POLL_SECONDS))

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _read(self) -> None:
        assert self._process.stdout is not None
        with self._process.stdout:
            for line in self._process.stdout:
                with self._arrived:
                    self._lines.append(line.decode(errors="replace"))
                    self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()  # the end of the output: the daemon is exiting

    def _await_output(self, seconds: float) -> None:
        if self._reader is None:
            time.sleep(seconds)  # a log file tells no one it grew: read it again soon
            return
        with self._arrived:
            self._arrived.wait(seconds)

    def _finish(self) -> int:
        """Once the daemon has exited: the rest of its output read (the reader closes
        the pipe at its end), the exit status."""
        if self._reader is not None:
            self._reader.join(DRAIN_SECONDS)
        return self._process.wait()


def stop_all(daemons: Sequence[DaemonProcess], timeout: float = STOP_SECONDS) -> None:
    """SIGTERM to every daemon first, so each finishes the work in its hands while the
    others do the same, then :meth:`DaemonProcess.stop` each (SIGKILL past
    ``timeout`` seconds)."""
    for daemon in daemons:
        daemon.terminate()
    for daemon in daemons:
        daemon.stop(timeout)


def _name_of(command: Sequence[str]) -> str:
    if len(command) > 2 and command[1] == "-m":
        return command[2]
    return Path(command[0]).name if command else "?"
