"""CPU time of groups of processes, from ``/proc``: the benchmarks' CPU budget per operation.

A group is a set of root processes: the pids of the benchmark's own children
(:class:`Pids`), or every process of a given name whose parent is not of that name,
optionally run with given arguments (:class:`Named`: the RabbitMQ node's ``beam.smp``,
``epmd``), or the roots of several such (:class:`AnyOf`). A root's CPU is the ``utime + stime``
of ``/proc/<pid>/stat`` (fields 14 and 15, whole thread group, in clock ticks) of the
root and of each of its descendants alive at the time, plus their ``cutime + cstime``
(fields 16 and 17): what the children they waited for used. So a Postgres backend that
exits and is reaped by the postmaster keeps its ticks in the postmaster's group; a
process reaped by a parent outside the group (a root whose parent is the benchmark, say)
takes them with it.

:meth:`ProcessGroups.snapshot` at the start and at the end of a window,
:meth:`ProcessGroups.delta` between the two: a root alive at both counts its tree's
ticks in between; a root that appeared in the window counts all of its tree's ticks;
a root gone by the end counts nothing and is listed in :attr:`Usage.lost` (its window's
ticks are missing). The resolution is one clock tick (10 ms at 100 Hz) per process.
Linux only.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TOTAL = "total"


@dataclass(frozen=True)
class Stat:
    """What ``/proc/<pid>/stat`` says of one process."""

    pid: int
    comm: str
    ppid: int
    own: int  # utime + stime, clock ticks
    reaped: int  # cutime + cstime: the children it waited for, clock ticks
    started: int  # starttime, clock ticks after boot: with pid, the process's identity

    @property
    def identity(self) -> tuple[int, int]:
        return self.pid, self.started


def parse_stat(text: str) -> Stat:
    """One ``/proc/<pid>/stat`` line. The command name sits in parentheses and may hold
    spaces and parentheses of its own: the fields after it follow the last ``)``."""
    head, _, tail = text.rpartition(")")
    pid_text, _, comm = head.partition(" (")
    # tail[0] is field 3 (state): field n is fields[n - 3].
    fields = tail.split()
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return Stat(
        pid=int(pid_text),
        comm=comm,
        ppid=int(fields[1]),
        own=utime + stime,
        reaped=cutime + cstime,
        started=int(fields[19]),
    )


def read_stat(pid: int, proc: Path = PROC) -> Stat | None:
    """The process's stat, or None if it is gone (or never was)."""
    try:
        return parse_stat((proc / str(pid) / "stat").read_text())
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
        return None


def scan(proc: Path = PROC) -> dict[int, Stat]:
    """Every process visible now, by pid."""
    processes: dict[int, Stat] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name), proc)
            if stat is not None:
                processes[stat.pid] = stat
    return processes


def descendants(root: int, processes: Mapping[int, Stat]) -> list[int]:
    """``root`` (if alive) and every alive process below it."""
    if root not in processes:
        return []
    children: dict[int, list[int]] = {}
    for stat in processes.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found, frontier = [root], [root]
    while frontier:
        below = [pid for parent in frontier for pid in children.get(parent, ()) if pid != parent]
        found += below
        frontier = below
    return found


def tree_ticks(root: int, processes: Mapping[int, Stat]) -> int:
    """Clock ticks used by ``root``, its alive descendants and the children they reaped."""
    return sum(processes[pid].own + processes[pid].reaped for pid in descendants(root, processes))


def cpu_seconds(pids: Iterable[int], processes: Mapping[int, Stat] | None = None) -> float:
    """CPU seconds used so far by ``pids``, their alive descendants and the children they
    reaped (0 for a pid that is gone)."""
    processes = scan() if processes is None else processes
    return sum(tree_ticks(pid, processes) for pid in set(pids)) / CLOCK_TICKS


class Selector(Protocol):
    def roots(self, processes: Mapping[int, Stat]) -> list[int]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Pids:
    """Given processes (the benchmark's children), each with what runs below it."""

    pids: tuple[int, ...]
    label: str = ""  # what they are, for describe()

    def roots(self, processes: Mapping[int, Stat]) -> list[int]:
        return [pid for pid in self.pids if pid in processes]

    def describe(self) -> str:
        pids = "pid " + ", ".join(str(pid) for pid in self.pids)
        return f"{self.label} ({pids})" if self.label else pids


def command_line(pid: int, proc: Path = PROC) -> list[str]:
    """The process's arguments (empty if it is gone, or a kernel thread)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def contains(sequence: Sequence[str], part: Sequence[str]) -> bool:
    """Whether ``part`` occurs in ``sequence`` as consecutive items."""
    width = len(part)
    return any(
        list(sequence[i : i + width]) == list(part) for i in range(len(sequence) - width + 1)
    )


@dataclass(frozen=True)
class Named:
    """Every process named one of ``names`` (``/proc/<pid>/comm``) whose parent is not:
    a server's top process, which has the others below it. With ``arguments``, only
    those whose command line holds them in a row (the RabbitMQ node's ``-s rabbit boot``,
    not the Erlang VM a ``rabbitmqctl`` runs)."""

    names: frozenset[str]
    arguments: tuple[str, ...] = ()
    proc: Path = PROC

    def roots(self, processes: Mapping[int, Stat]) -> list[int]:
        def named(pid: int) -> bool:
            stat = processes.get(pid)
            return stat is not None and stat.comm in self.names

        candidates = sorted(
            pid for pid, stat in processes.items() if named(pid) and not named(stat.ppid)
        )
        if not self.arguments:
            return candidates
        return [pid for pid in candidates if contains(command_line(pid, self.proc), self.arguments)]

    def describe(self) -> str:
        described = "processes named " + ", ".join(sorted(self.names))
        if self.arguments:
            described += " run with " + " ".join(self.arguments)
        return described


def listening_sockets(port: int, proc: Path = PROC) -> set[str]:
    """The inodes of the TCP sockets listening on ``port`` (IPv4 and IPv6) in this
    process's network namespace."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc / "net" / table).read_text().splitlines()[1:]
        except (FileNotFoundError, PermissionError):
            continue
        for row in rows:
            # sl local_address rem_address st ... inode: "0100007F:1628", st 0A = LISTEN
            fields = row.split()
            if (
                len(fields) > 9
                and fields[3] == "0A"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(fields[9])
    return inodes


def socket_owners(inodes: set[str], pids: Iterable[int], proc: Path = PROC) -> list[int]:
    """Which of ``pids`` hold one of the sockets (reading another user's descriptors needs
    root: those are skipped)."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    owners: list[int] = []
    for pid in pids:
        try:
            descriptors = list((proc / str(pid) / "fd").iterdir())
        except (FileNotFoundError, PermissionError):
            continue
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor) in wanted:
                    owners.append(pid)
                    break
            except OSError:
                continue
    return owners


@dataclass(frozen=True)
class AnyOf:
    """The roots of several selectors."""

    selectors: tuple[Selector, ...]

    def roots(self, processes: Mapping[int, Stat]) -> list[int]:
        return sorted({pid for selector in self.selectors for pid in selector.roots(processes)})

    def describe(self) -> str:
        return "; ".join(selector.describe() for selector in self.selectors)


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic()
    ticks: dict[str, dict[tuple[int, int], int]]  # group -> root identity -> tree ticks


@dataclass
class Usage:
    """CPU seconds per group over a window of ``seconds``; a group none of whose
    processes was seen at either end is in ``unseen``, not in ``cpu``."""

    seconds: float
    cpu: dict[str, float]
    lost: dict[str, int] = field(default_factory=dict)  # group -> roots gone by the end
    unseen: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.cpu.values())

    def ms_per_op(self, operations: int) -> dict[str, float]:
        """Milliseconds of CPU per operation, per group and in all (``total``)."""
        per = {
            name: seconds * 1000 / operations if operations > 0 else math.nan
            for name, seconds in self.cpu.items()
        }
        per[TOTAL] = self.total * 1000 / operations if operations > 0 else math.nan
        return per

    def cores_busy(self) -> float:
        """How many CPUs the groups kept busy on average over the window."""
        return self.total / self.seconds if self.seconds > 0 else math.nan


class ProcessGroups:
    """Named groups of processes whose CPU time is read at the start and at the end of a
    window."""

    def __init__(self, groups: Mapping[str, Selector], proc: Path = PROC) -> None:
        self.groups = dict(groups)
        self.proc = proc

    def snapshot(self) -> Snapshot:
        processes = scan(self.proc)
        return Snapshot(
            at=time.monotonic(),
            ticks={
                name: {
                    processes[root].identity: tree_ticks(root, processes)
                    for root in selector.roots(processes)
                }
                for name, selector in self.groups.items()
            },
        )

    def delta(self, start: Snapshot, end: Snapshot) -> Usage:
        cpu: dict[str, float] = {}
        lost: dict[str, int] = {}
        unseen: list[str] = []
        for name in self.groups:
            before, after = start.ticks.get(name, {}), end.ticks.get(name, {})
            if not before and not after:
                unseen.append(name)
                continue
            # A tree can shrink (a descendant orphaned to a parent outside it): never below 0.
            ticks = sum(max(0, value - before.get(root, 0)) for root, value in after.items())
            gone = sum(1 for root in before if root not in after)
            cpu[name] = ticks / CLOCK_TICKS
            if gone:
                lost[name] = gone
        return Usage(seconds=end.at - start.at, cpu=cpu, lost=lost, unseen=unseen)

    def describe(self) -> dict[str, str]:
        return {name: selector.describe() for name, selector in self.groups.items()}
