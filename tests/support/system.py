"""The whole system for acceptance tests: the payment sandbox in process, and the
dispatcher and consumer daemons as real subprocesses pointed at this test's database,
broker names and sandbox."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import psycopg

from outbox import Operation, OperationState, Registry, Settings, record_decision
from outbox import store as outbox_store
from outbox.sandbox.processes import DaemonProcess, python_module
from outbox.sandbox.provider import Faults, SandboxProvider
from outbox.sandbox.tools import (
    CALLBACK_WAIT_ENV,
    OUTAGE_TOLERANCE_ENV,
    REFUND_DEADLINE_ENV,
    SANDBOX_URL_ENV,
    build_registry,
)
from outbox.store import Store

from support.waiting import eventually_sync

SETTLED = (OperationState.COMMITTED, OperationState.REJECTED, OperationState.ESCALATED)
# What points a daemon at this test's database and broker names.
CONNECTION_SETTINGS = (
    "database_url",
    "amqp_url",
    "exchange",
    "queue",
    "dead_letter_exchange",
    "dead_letter_queue",
    "tool_queues",
)
# A daemon that does not stop within this after SIGTERM fails the test that waits.
STOP_SECONDS = 30.0


class Daemon(DaemonProcess):
    """A daemon under test (``python -m <kind>``, or ``command``), its output captured so
    that the test can wait for a line or read all of it."""

    def __init__(
        self, kind: str, environment: dict[str, str], command: Sequence[str] | None = None
    ) -> None:
        super().__init__(
            command or python_module(kind), environment=environment, capture=True, name=kind
        )
        self.kind = kind

    def output(self) -> str:
        """Everything the daemon wrote, once it has exited (stopped with SIGTERM first)."""
        self.stop(STOP_SECONDS)
        return super().output()


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
        daemon = Daemon(kind, self.environment)
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
    callback_wait: float = 0.0,
    outage_tolerance: float | None = None,
) -> Iterator[System]:
    """The sandbox in process and what its daemons read. No callbacks receiver runs
    unless a test starts one, so an unknown email waits ``callback_wait`` (none, by
    default) for a callback before its contract sends it to a person."""
    with SandboxProvider(faults=faults, payment_amount_cents=payment_amount_cents) as provider:
        daemon = daemon_settings(
            settings,
            tools="outbox.sandbox.tools",
            poll_interval=0.2,
            reconcile_interval=0.1,
            # Database bounds a busy machine meets (by default they derive from the
            # margin), and a margin just longer, as it must be: a takeover waits for the
            # tool's deadline plus these 6 s.
            lease_margin=6.0,
            db_transaction_timeout=5.0,
            metrics_host="127.0.0.1",
            metrics_port=0,
            declare_topology=settings.declare_topology,
        )
        environment = {
            **os.environ,
            **daemon.to_environment(),
            SANDBOX_URL_ENV: provider.url,
            REFUND_DEADLINE_ENV: str(refund_deadline),
            CALLBACK_WAIT_ENV: str(callback_wait),
        }
        if outage_tolerance is not None:
            environment[OUTAGE_TOLERANCE_ENV] = str(outage_tolerance)
        system = System(settings=settings, provider=provider, environment=environment)
        try:
            yield system
        finally:
            for started in system.daemons:
                started.kill()


def daemon_settings(settings: Settings, **changes: Any) -> Settings:
    """What a daemon started by this test reads: this process's own ``OUTBOX_*``
    environment (which it inherits), pointed at the test's database and broker names,
    with ``changes``. The rest of the test's ``settings`` (its quick publish retries,
    its declare_topology) stays the test's own."""
    pointed = {name: getattr(settings, name) for name in CONNECTION_SETTINGS}
    return Settings(**{**pointed, **changes})


def connection_environment(settings: Settings, **changes: Any) -> dict[str, str]:
    """The ``OUTBOX_*`` variables of a subprocess pointed at this test's database and
    broker names (with ``changes``)."""
    return daemon_settings(settings, **changes).to_environment()
