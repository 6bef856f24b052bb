"""bench/cpu.py: CPU time of process groups from /proc, for the benchmarks' CPU budget."""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from bench.cpu import (
    CLOCK_TICKS,
    AnyOf,
    Named,
    Pids,
    ProcessGroups,
    Snapshot,
    Stat,
    command_line,
    contains,
    cpu_seconds,
    descendants,
    listening_sockets,
    parse_stat,
    read_stat,
    scan,
    socket_owners,
    tree_ticks,
)
from outbox.sandbox.processes import DaemonProcess

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")

# A child that is ready, then waits (blocked, using no CPU) for SIGUSR1; on each one it
# does a bounded amount of work, says so, and waits again. "--spawn" does the work in a
# grandchild it waits for (reaps), "--idle" never works.
CHILD = """
import signal, subprocess, sys
BURN = "x = 0\\nfor i in range(3_000_000):\\n    x += i * i\\n"
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print("ready", flush=True)
while True:
    signal.sigwait({signal.SIGUSR1})
    if "--idle" in sys.argv:
        continue
    if "--spawn" in sys.argv:
        subprocess.run([sys.executable, "-c", BURN], check=True)
    else:
        exec(BURN)
    print("worked", flush=True)
"""


def child(*args: str) -> DaemonProcess:
    process = DaemonProcess([sys.executable, "-c", CHILD, *args], capture=True, name="cpu")
    process.wait_for_line("ready", within=30)
    return process


def burn(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def fake(pid: int, ppid: int, comm: str = "python", own: int = 0, reaped: int = 0) -> Stat:
    return Stat(pid=pid, comm=comm, ppid=ppid, own=own, reaped=reaped, started=pid * 10)


def fake_proc(root: Path, stats: list[Stat], commands: dict[int, list[str]] | None = None) -> Path:
    """A /proc of the given processes (stat and cmdline), replacing what was there."""
    for entry in root.glob("[0-9]*"):
        for file in entry.iterdir():
            file.unlink()
        entry.rmdir()
    for stat in stats:
        directory = root / str(stat.pid)
        directory.mkdir()
        # own and reaped split as utime/stime 1:0 and cutime/cstime 1:0.
        (directory / "stat").write_text(
            f"{stat.pid} ({stat.comm}) S {stat.ppid} 1 1 0 -1 0 0 0 0 0 "
            f"{stat.own} 0 {stat.reaped} 0 20 0 1 0 {stat.started} 0 0\n"
        )
        arguments = (commands or {}).get(stat.pid, [stat.comm])
        (directory / "cmdline").write_bytes("".join(f"{a}\0" for a in arguments).encode())
    return root


def test_a_stat_line_is_parsed_past_a_name_with_spaces_and_parentheses() -> None:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime ...
    line = "4242 (a (b) c) S 7 4242 4242 0 -1 4194560 10 0 0 0 5 3 11 2 20 0 1 0 98765 0 0\n"

    stat = parse_stat(line)

    assert stat == Stat(pid=4242, comm="a (b) c", ppid=7, own=8, reaped=13, started=98765)


def test_this_process_reads_its_own_stat_and_its_work_shows() -> None:
    stat = read_stat(os.getpid())
    assert stat is not None
    assert stat.pid == os.getpid()
    assert stat.ppid == os.getppid()
    assert stat.comm == Path("/proc/self/comm").read_text().strip()

    before = stat.own
    burn(3_000_000)  # a few hundred ms of CPU: tens of ticks
    after = read_stat(os.getpid())

    assert after is not None
    assert after.own > before


def test_a_pid_that_is_not_there_reads_as_none_and_as_no_cpu() -> None:
    missing = 2**22 + 1  # above pid_max's default ceiling
    assert read_stat(missing) is None
    assert cpu_seconds([missing]) == 0.0


def test_a_busy_child_shows_cpu_and_an_idle_one_none() -> None:
    busy, idle = child(), child("--idle")
    try:
        groups = ProcessGroups({"busy": Pids((busy.pid,)), "idle": Pids((idle.pid,))})
        start = groups.snapshot()
        busy.signal(signal.SIGUSR1)
        idle.signal(signal.SIGUSR1)
        busy.wait_for_line("worked", within=30)
        end = groups.snapshot()
    finally:
        busy.stop(timeout=10)
        idle.stop(timeout=10)

    usage = groups.delta(start, end)

    assert usage.cpu["busy"] > 0.05
    assert usage.cpu["idle"] <= 2 / CLOCK_TICKS  # woken once: at most a tick or two
    assert usage.lost == {}
    assert usage.seconds > 0
    assert usage.total == pytest.approx(usage.cpu["busy"] + usage.cpu["idle"])
    per = usage.ms_per_op(10)
    assert per["busy"] == pytest.approx(usage.cpu["busy"] * 100)
    assert per["total"] == pytest.approx(usage.total * 100)


def test_a_child_that_exited_and_was_reaped_inside_the_group_keeps_its_ticks() -> None:
    # As a Postgres backend does under the postmaster: the grandchild has exited by the
    # end, and its parent (the root) counts it in cutime + cstime.
    parent = child("--spawn")
    try:
        groups = ProcessGroups({"tree": Pids((parent.pid,))})
        start = groups.snapshot()
        parent.signal(signal.SIGUSR1)
        parent.wait_for_line("worked", within=30)
        end = groups.snapshot()
        alive = read_stat(parent.pid)
    finally:
        parent.stop(timeout=10)

    assert alive is not None
    assert alive.reaped > 0
    assert groups.delta(start, end).cpu["tree"] > 0.05


def test_a_root_gone_by_the_end_counts_nothing_and_is_reported_lost() -> None:
    gone = child()
    groups = ProcessGroups({"gone": Pids((gone.pid,))})
    start = groups.snapshot()
    gone.stop(timeout=10)  # reaped by this process, outside the group

    usage = groups.delta(start, groups.snapshot())

    assert usage.cpu["gone"] == 0.0
    assert usage.lost == {"gone": 1}


def test_descendants_and_tree_ticks_walk_the_whole_tree() -> None:
    processes = {
        1: fake(1, 0, "init"),
        10: fake(10, 1, "postgres", own=5, reaped=100),
        11: fake(11, 10, "postgres", own=7),
        12: fake(12, 11, "sh", own=1),
        20: fake(20, 1, "python", own=50),
    }

    assert sorted(descendants(10, processes)) == [10, 11, 12]
    assert descendants(99, processes) == []
    assert tree_ticks(10, processes) == 5 + 100 + 7 + 1
    assert cpu_seconds([10, 10], processes) == pytest.approx(113 / CLOCK_TICKS)


def test_named_groups_root_at_the_top_process_of_that_name() -> None:
    processes = {
        1: fake(1, 0, "init"),
        10: fake(10, 1, "postgres"),
        11: fake(11, 10, "postgres"),
        30: fake(30, 1, "beam.smp"),
        31: fake(31, 30, "erl_child_setup"),
        40: fake(40, 1, "epmd"),
    }

    assert Named(frozenset({"postgres"})).roots(processes) == [10]
    assert Named(frozenset({"beam.smp", "epmd"})).roots(processes) == [30, 40]
    assert Pids((10, 99)).roots(processes) == [10]


def test_a_root_that_appears_in_the_window_counts_all_its_ticks() -> None:
    groups = ProcessGroups({"server": Named(frozenset({"postgres"}))})
    start = groups.snapshot()
    end = Snapshot(
        at=start.at + 2.0,
        ticks={"server": {**start.ticks["server"], (123456789, 1): 3 * CLOCK_TICKS}},
    )

    usage = groups.delta(start, end)

    assert usage.cpu["server"] == pytest.approx(3.0)
    assert usage.cores_busy() == pytest.approx(1.5)


def test_a_window_over_a_fake_proc_counts_exited_backends_and_restarted_nodes(
    tmp_path: Path,
) -> None:
    node = ["beam.smp", "-s", "rabbit", "boot"]
    cli = ["beam.smp", "-s", "elixir", "start_cli", "rabbitmqctl"]
    proc = fake_proc(
        tmp_path,
        [
            fake(1, 0, "init"),
            fake(10, 1, "postgres", own=100, reaped=1000),
            fake(11, 10, "postgres", own=40),  # a backend that exits in the window
            fake(12, 10, "postgres", own=5),
            fake(30, 1, "beam.smp", own=500),
            fake(31, 1, "beam.smp", own=70),  # a rabbitmqctl's VM: not the node
            fake(40, 1, "epmd", own=1),
        ],
        {30: node, 31: cli},
    )
    rabbitmq = AnyOf(
        (Named(frozenset({"beam.smp"}), ("rabbit", "boot"), proc), Named(frozenset({"epmd"})))
    )
    groups = ProcessGroups(
        {"postgres": Named(frozenset({"postgres"})), "rabbitmq": rabbitmq}, proc=proc
    )
    start = groups.snapshot()
    fake_proc(
        proc,
        [
            fake(1, 0, "init"),
            # Reaped backend 11 (40 ticks before, 60 in the window) in the postmaster's
            # cutime; 12 worked 20 ticks; the postmaster 3.
            fake(10, 1, "postgres", own=103, reaped=1100),
            fake(12, 10, "postgres", own=25),
            # The node restarted: the old one gone, a new one (another pid) from scratch.
            fake(33, 1, "beam.smp", own=250),
            fake(31, 1, "beam.smp", own=900),
            fake(40, 1, "epmd", own=2),
        ],
        {33: node, 31: cli},
    )

    usage = groups.delta(start, groups.snapshot())

    assert usage.cpu["postgres"] == pytest.approx((3 + 60 + 20) / CLOCK_TICKS)
    assert usage.cpu["rabbitmq"] == pytest.approx((250 + 1) / CLOCK_TICKS)
    assert usage.lost == {"rabbitmq": 1}
    assert sorted(scan(proc)) == [1, 10, 12, 31, 33, 40]


def test_command_lines_and_runs_of_arguments(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, [fake(5, 1, "beam.smp")], {5: ["beam.smp", "-s", "rabbit", "boot"]})

    assert command_line(5, proc) == ["beam.smp", "-s", "rabbit", "boot"]
    assert command_line(6, proc) == []
    assert contains(["-s", "rabbit", "boot"], ("rabbit", "boot"))
    assert not contains(["-s", "rabbit", "x", "boot"], ("rabbit", "boot"))
    assert not contains(["rabbit"], ("rabbit", "boot"))


def test_no_operations_means_no_figure_and_a_group_never_seen_no_cpu() -> None:
    groups = ProcessGroups({"self": Pids((os.getpid(),)), "nobody": Pids((2**22 + 1,))})
    usage = groups.delta(groups.snapshot(), groups.snapshot())

    assert list(usage.cpu) == ["self"]
    assert usage.unseen == ["nobody"]
    assert math.isnan(usage.ms_per_op(0)["total"])
    assert math.isnan(usage.ms_per_op(0)["self"])


def test_the_owner_of_a_listening_socket_is_found() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        inodes = listening_sockets(port)

        assert len(inodes) == 1
        assert socket_owners(inodes, [os.getppid(), os.getpid()]) == [os.getpid()]
    assert listening_sockets(port) == set()
