"""The whole system for acceptance tests: the payment sandbox in process, and the
dispatcher and consumer daemons as real subprocesses pointed at this test's database,
broker names and sandbox."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import psycopg

from outbox import Operation, OperationState, Registry, Settings, record_decision
from outbox import store as outbox_store
from outbox.sandbox.provider import Faults, SandboxProvider
from outbox.sandbox.tools import REFUND_DEADLINE_ENV, build_registry
from outbox.store import Store

from support.waiting import eventually_sync

SETTLED = (OperationState.COMMITTED, OperationState.REJECTED, OperationState.ESCALATED)


@dataclass
class Daemon:
    kind: str
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Read the output as it comes, so a test can wait for a line while it runs.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    def wait_for_line(self, marker: str, within: float = 20) -> None:
        eventually_sync(
            lambda: any(marker in line for line in self.lines),
            within=within,
            what=f"{self.kind} to log {marker!r}",
        )

    def output(self) -> str:
        """Everything the daemon wrote, once it has exited (stopped with SIGTERM)."""
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=30)
        self._reader.join(timeout=10)
        return "".join(self.lines)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process cannot die
            self.process.kill()
        self.process.wait(timeout=30)
        self._reader.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()


@dataclass
class System:
    settings: Settings
    provider: SandboxProvider
    environment: dict[str, str]
    registry: Registry = field(default_factory=build_registry)
    daemons: list[Daemon] = field(default_factory=list)

    @property
    def database_url(self) -> str:
        return self.settings.database_url.get_secret_value()

    def start(self, kind: str) -> Daemon:
        # This interpreter and one of the project's own modules.
        process = subprocess.Popen(
            [sys.executable, "-m", kind],
            env=self.environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        daemon = Daemon(kind, process)
        self.daemons.append(daemon)
        return daemon

    def decide(self, tool: str = "send_refund", **fields: Any) -> Operation:
        tool_input = (
            {"payment_id": "pay_1", "amount_cents": 1250, **fields}
            if tool == "send_refund"
            else fields
        )
        with psycopg.connect(self.database_url) as connection:
            recorded = record_decision(connection, self.registry, tool, tool_input, run_id="run")
            connection.commit()
        return recorded.operation

    def operation(self, operation_id: UUID) -> Operation:
        with psycopg.connect(self.database_url) as connection:
            return Store(connection).run(outbox_store.get_operation(operation_id))

    def events(self, operation_id: UUID) -> list[str]:
        with psycopg.connect(self.database_url) as connection:
            return [e.name for e in Store(connection).run(outbox_store.events(operation_id))]

    def wait_for(
        self, operation_id: UUID, *states: OperationState, within: float = 30
    ) -> Operation:
        wanted = states or SETTLED
        eventually_sync(
            lambda: self.operation(operation_id).state in wanted,
            within=within,
            what=f"{operation_id} in {[str(s) for s in wanted]}",
        )
        return self.operation(operation_id)

    def refunds_for(self, operation_id: UUID) -> int:
        return int(self.provider.ledger()["refunds_by_key"].get(str(operation_id), 0))


@contextlib.contextmanager
def running_system(
    settings: Settings,
    *,
    faults: Faults | None = None,
    refund_deadline: float = 1.0,
    payment_amount_cents: int = 100_000,
) -> Iterator[System]:
    with SandboxProvider(faults=faults, payment_amount_cents=payment_amount_cents) as provider:
        environment = {
            **os.environ,
            **connection_environment(settings),
            "OUTBOX_TOOLS": "outbox.sandbox.tools",
            "OUTBOX_SANDBOX_URL": provider.url,
            REFUND_DEADLINE_ENV: str(refund_deadline),
            "OUTBOX_POLL_INTERVAL": "0.2",
            "OUTBOX_RECONCILE_INTERVAL": "0.1",
            "OUTBOX_LEASE_MARGIN": "0.5",
            # Short leases for quick takeovers; database bounds a busy machine meets
            # (by default they derive from the margin: 0.25 s here).
            "OUTBOX_DB_TRANSACTION_TIMEOUT": "5",
            "OUTBOX_METRICS_HOST": "127.0.0.1",
            "OUTBOX_METRICS_PORT": "0",
            "OUTBOX_DECLARE_TOPOLOGY": str(settings.declare_topology).lower(),
        }
        system = System(settings=settings, provider=provider, environment=environment)
        try:
            yield system
        finally:
            for daemon in system.daemons:
                daemon.close()


def connection_environment(settings: Settings) -> dict[str, str]:
    """The ``OUTBOX_*`` variables that point a subprocess at this test's database and
    broker names."""
    return {
        "OUTBOX_DATABASE_URL": settings.database_url.get_secret_value(),
        "OUTBOX_AMQP_URL": settings.amqp_url.get_secret_value(),
        "OUTBOX_EXCHANGE": settings.exchange,
        "OUTBOX_QUEUE": settings.queue,
        "OUTBOX_DEAD_LETTER_EXCHANGE": settings.dead_letter_exchange,
        "OUTBOX_DEAD_LETTER_QUEUE": settings.dead_letter_queue,
    }
