"""``outbox consumer --processes N``: N consumers under one supervisor, each decision
still executed once, stopped together, and a child's death ends the group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from uuid import UUID

import psycopg
import pytest

from outbox import OperationState, Settings, store
from outbox.sandbox.processes import python_module
from outbox.store import Store

from support.system import SETTLED, STOP_SECONDS, Daemon, System, running_system
from support.waiting import eventually_sync

S = OperationState


def start_supervised(system: System, processes: int) -> tuple[Daemon, list[int]]:
    """The supervisor and its children's pids, once every child has its broker session."""
    supervisor = Daemon(
        "consumer",
        system.environment,
        command=python_module("consumer", "--processes", str(processes)),
    )
    system.daemons.append(supervisor)
    started = supervisor.wait_for_line("consumer.supervisor_started")
    match = re.search(r"pids=\"?([0-9,]+)", started)
    assert match is not None, started
    pids = [int(pid) for pid in match.group(1).split(",")]
    try:
        eventually_sync(
            lambda: written(supervisor).count("consumer.session_ready") == processes,
            within=30,
            what=f"{processes} consumer sessions ready",
        )
    except AssertionError as missing:
        raise AssertionError(
            f"{missing}; the supervisor's last lines:\n{supervisor.tail()}"
        ) from None
    return supervisor, pids


def written(daemon: Daemon) -> str:
    """What the daemon wrote so far, without stopping it (``Daemon.output`` stops it)."""
    return "".join(daemon.lines)


def attempted_by(system: System, operation_id: UUID) -> list[int]:
    """The pids of the consumers that attempted the operation (its attempted events
    name the worker: host:pid:instance)."""
    with psycopg.connect(system.database_url) as connection:
        events = Store(connection).run(store.events(operation_id))
    return [
        int(str(event.attributes["worker"]).split(":")[1])
        for event in events
        if event.name == "operation.attempted"
    ]


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs: an exited child nobody has reaped yet (a zombie,
    when this machine's init reaps slowly or never) has ended too."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_two_processes_share_the_work_and_stop_together(settings: Settings) -> None:
    with running_system(settings) as system:
        system.start("dispatcher")
        supervisor, pids = start_supervised(system, 2)
        assert len(set(pids)) == 2
        assert supervisor.pid not in pids

        operations = [system.decide(payment_id=f"pay_{n}") for n in range(20)]
        owners = set()
        for operation in operations:
            final = system.wait_for(operation.id, *SETTLED)
            assert final.state is S.COMMITTED
            assert system.refunds_for(operation.id) == 1
            owners |= {pid for pid in attempted_by(system, operation.id)}
        # The broker hands deliveries to both children in turn: both did work.
        assert owners == set(pids)

        assert supervisor.stop(STOP_SECONDS) == 0
        output = supervisor.output()
        assert "consumer.supervisor_stopped" in output
        # Each child stopped gracefully, once: one signal reached it, not two.
        assert output.count("consumer.stopping") == 2
        assert "consumer.killed" not in output
        eventually_sync(
            lambda: not any(alive(pid) for pid in pids), within=10, what="children gone"
        )


def test_a_child_that_dies_ends_the_group_with_status_1(settings: Settings) -> None:
    with running_system(settings) as system:
        supervisor, pids = start_supervised(system, 2)
        os.kill(pids[0], signal.SIGKILL)
        assert supervisor.wait(STOP_SECONDS) == 1
        output = supervisor.output()
        assert "consumer.process_exited" in output
        assert f"pid={pids[0]}" in output
        # The survivor was stopped gracefully, not left running on its own.
        assert output.count("consumer.stopping") == 1
        eventually_sync(lambda: not alive(pids[1]), within=10, what="the other child gone")


def test_a_killed_supervisor_takes_its_children_with_it(settings: Settings) -> None:
    with running_system(settings) as system:
        supervisor, pids = start_supervised(system, 2)
        supervisor.kill()
        eventually_sync(
            lambda: not any(alive(pid) for pid in pids), within=STOP_SECONDS, what="orphans gone"
        )


@pytest.mark.parametrize("count", ["0", "65", "two", "-1"])
def test_a_bad_process_count_is_refused_before_anything_starts(count: str) -> None:
    result = subprocess.run(
        python_module("consumer", "--processes", count),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--processes" in result.stderr
    assert "supervisor_started" not in result.stderr
