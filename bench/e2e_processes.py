"""bench/e2e.py's parent side of a system's processes: starting them stage by stage,
which processes each CPU group counts, waiting for the effects, a window's CPU budget."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg

from bench.cpu import (
    TOTAL,
    AnyOf,
    Named,
    Pids,
    ProcessGroups,
    Selector,
    Usage,
    listening_sockets,
    read_stat,
    scan,
    socket_owners,
)
from bench.systems import Context, System
from outbox.sandbox.processes import DaemonProcess, stop_all

REPOSITORY = Path(__file__).resolve().parents[1]
# The CPU budget's process groups: the writers (in the latency window only: the drain's
# backlog is written before its window), the dispatcher (the minimal pipeline's relay;
# pgqueuer and procrastinate have none), the consumers (the peers' workers), every
# process of the Postgres server and of the RabbitMQ node.
CPU_GROUPS = ("writer", "dispatcher", "consumers", "postgres", "rabbitmq")
# The RabbitMQ nodes on this machine (not the Erlang VMs that rabbitmqctl runs), and their
# port mapper.
RABBITMQ_NODES = Named(frozenset({"beam.smp"}), arguments=("rabbit", "boot"))
EPMD = Named(frozenset({"epmd"}))
POSTGRES_PROCESSES = frozenset({"postgres", "postmaster"})


@dataclass
class Bench:
    context: Context
    systems: dict[str, System]
    logs: Path
    # The Postgres server's processes: its postmaster (found from a backend of ours) and
    # everything below it, or, if that is not visible here, every process so named.
    postgres: Selector = field(default_factory=lambda: Named(POSTGRES_PROCESSES))
    # The RabbitMQ node that listens on --amqp-url's port, with epmd.
    rabbitmq: Selector = field(default_factory=lambda: AnyOf((RABBITMQ_NODES, EPMD)))
    failures: list[str] = field(default_factory=list)
    spawned: int = 0

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> DaemonProcess:
        self.spawned += 1
        log = self.logs / f"{self.spawned:03d}-{name}.log"
        return DaemonProcess(argv, environment=env, log=log, cwd=REPOSITORY, name=name)

    @contextlib.contextmanager
    def running(self, system: System, url: str) -> Iterator[Running]:
        """The system's processes, stage by stage, each stage ready before the next
        starts; stopped (SIGTERM, then SIGKILL) on the way out."""
        running = Running()
        try:
            for stage in system.daemons(url):
                started = [
                    (
                        daemon.group,
                        self.spawn(
                            f"{system.name}-{daemon.name}", daemon.argv, dict(daemon.environment)
                        ),
                        daemon.ready_line,
                    )
                    for daemon in stage
                ]
                for group, child, _ in started:
                    running.add(group, child)
                wait_ready([(child, marker) for _, child, marker in started])
            yield running
        finally:
            stop_all(running.children)

    def process_groups(self, system: System, running: Running) -> ProcessGroups:
        """The CPU groups of a window: the system's daemons, Postgres, and RabbitMQ for
        the systems that use it (the writers, when in the window, measure themselves)."""
        groups: dict[str, Selector] = {
            group: Pids(tuple(child.pid for child in children))
            for group, children in running.groups.items()
        }
        groups["postgres"] = self.postgres
        if system.uses_broker:
            groups["rabbitmq"] = self.rabbitmq
        return ProcessGroups(groups)


@dataclass
class Running:
    """A system's daemons, each in its CPU group."""

    children: list[DaemonProcess] = field(default_factory=list)
    groups: dict[str, list[DaemonProcess]] = field(default_factory=dict)

    def add(self, group: str, child: DaemonProcess) -> None:
        self.children.append(child)
        self.groups.setdefault(group, []).append(child)


def postgres_selector(url: str) -> Selector:
    """The server's postmaster, the parent of the backend that serves this connection,
    if this machine sees it (a server elsewhere, or in a container of its own, is not
    seen: then every process named postgres)."""
    with psycopg.connect(url, autocommit=True) as connection:
        row = connection.execute("SELECT pg_backend_pid()").fetchone()
        backend = read_stat(int(row[0])) if row else None
        if backend is not None and backend.comm in POSTGRES_PROCESSES:
            postmaster = read_stat(backend.ppid)
            if postmaster is not None and postmaster.comm in POSTGRES_PROCESSES:
                return Pids((postmaster.pid,), "the postmaster and every process below it")
    return Named(POSTGRES_PROCESSES)


def rabbitmq_selector(amqp_url: str) -> Selector:
    """The node that listens on the URL's port, if this machine shows which one it is
    (reading its descriptors takes root); else every RabbitMQ node here. With epmd."""
    split = urlsplit(amqp_url)
    port = split.port or (5671 if split.scheme == "amqps" else 5672)
    nodes = RABBITMQ_NODES.roots(scan())
    owners = socket_owners(listening_sockets(port), nodes)
    node = Pids(tuple(owners), f"the RabbitMQ node listening on port {port}")
    return AnyOf((node if owners else RABBITMQ_NODES, EPMD))


def wait_ready(children: Sequence[tuple[DaemonProcess, str]], within: float = 30.0) -> None:
    """Each child has written its ready line, all within ``within`` seconds."""
    deadline = time.monotonic() + within
    for child, marker in children:
        child.wait_for_line(marker, within=max(0.0, deadline - time.monotonic()))


def wait_for_effects(
    connection: psycopg.Connection[Any], system: System, expected: int, within: float
) -> int:
    """Effects recorded, polled on one open connection (a connection per poll would
    fork a backend each time, Postgres CPU inside the measured window)."""
    deadline = time.monotonic() + within
    done = system.count_effects(connection)
    while done < expected and time.monotonic() < deadline:
        time.sleep(0.2)
        done = system.count_effects(connection)
    return done


def cpu_budget(usage: Usage, operations: int) -> dict[str, Any]:
    """A window's CPU: seconds and ms per operation by group (and in all), how many
    CPUs the groups kept busy, roots that were gone by the window's end."""
    seconds = {group: usage.cpu[group] for group in CPU_GROUPS if group in usage.cpu}
    per_op = usage.ms_per_op(operations)
    return {
        "window_seconds": usage.seconds,
        "operations": operations,
        "cpu_seconds": {**seconds, TOTAL: usage.total},
        "cpu_ms_per_op": {group: per_op[group] for group in (*seconds, TOTAL)},
        "cores_busy": usage.cores_busy(),
        "lost_processes": usage.lost,
        "unseen_groups": usage.unseen,
    }
