"""The chaos run's four daemons, each through its restarts, kills and pauses."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from outbox.sandbox.processes import DaemonProcess, python_module


@dataclass
class Daemon:
    """One of the four daemons, through its restarts: each start is a new process, with
    a log file of its own."""

    kind: str
    index: int
    environment: dict[str, str]
    log_dir: Path
    metrics_port: int | None = None
    process: DaemonProcess | None = None
    generation: int = 0
    stopped_until: float | None = None

    def healthy(self) -> bool:
        """Whether its /healthz answers 200 (its sessions are up)."""
        if self.metrics_port is None or self.process is None or not self.process.running():
            return False
        url = f"http://127.0.0.1:{self.metrics_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    @property
    def name(self) -> str:
        return f"{self.kind}#{self.index}"

    def start(self) -> None:
        self.generation += 1
        self.process = DaemonProcess(
            python_module(self.kind),
            environment=self.environment,
            log=self.log_dir / f"{self.kind}{self.index}.{self.generation}.log",
            name=self.name,
        )
        self.stopped_until = None

    @property
    def current(self) -> DaemonProcess:
        assert self.process is not None, f"{self.name} was never started"
        return self.process

    @property
    def pid(self) -> int:
        return self.current.pid

    def kill_and_restart(self) -> None:
        self.current.kill()
        self.start()

    def pause(self, until: float) -> None:
        self.current.signal(signal.SIGSTOP)
        self.stopped_until = until

    def resume_if_due(self, now: float) -> bool:
        """Wake a paused daemon whose pause is over; True if it did."""
        if self.stopped_until is not None and now >= self.stopped_until:
            self.current.signal(signal.SIGCONT)
            self.stopped_until = None
            return True
        return False

    def exited_unplanned(self) -> bool:
        return self.process is not None and not self.process.running()
