"""Postgres servers of the test's own on this machine: for the tests that stop, kill,
promote or starve a database, which the shared server on 5432 must never suffer.

Each server is the installed major version's ``initdb`` + ``pg_ctl`` into one temporary
directory, listening on a free loopback port only (no Unix socket beside the shared
server's), trust authentication for loopback (replication included, so a standby can
be made with ``pg_basebackup``). Postgres refuses to run as root; when the tests run as
root, every server command runs as the ``postgres`` user, and the directory is theirs.

A standby is :meth:`PrivatePostgres.standby`: ``pg_basebackup -R`` from a running
primary, started in recovery; :meth:`PrivatePostgres.promote` makes it writable. A
crash is :meth:`PrivatePostgres.kill` (``pg_ctl stop -m immediate``: no checkpoint, no
goodbye to clients), an operator's stop is :meth:`PrivatePostgres.stop`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

# initdb takes 1-3 s on two quiet cores; a busy machine can make it 10x slower.
COMMAND_SECONDS = 120.0
POLL_SECONDS = 0.1
SERVER_USER = "postgres"


class PrivatePostgresError(RuntimeError):
    """A server command failed; the message carries the tail of the server's log."""


def bin_directory() -> Path | None:
    """The newest installed major version's ``bin``, or None without Postgres."""
    root = Path("/usr/lib/postgresql")
    versions = sorted(
        (entry for entry in root.glob("*") if (entry / "bin" / "initdb").exists()),
        key=lambda entry: int(entry.name) if entry.name.isdigit() else 0,
    )
    if versions:
        return versions[-1] / "bin"
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def installed() -> bool:
    return bin_directory() is not None


def free_port() -> int:
    """A local port nothing listens on: bound once to find it free, then released."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as_server_user() -> list[str]:
    """The prefix that runs a command as the user Postgres accepts: none unless root."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", SERVER_USER, "--"]


def _hand_to_server_user(path: Path) -> None:
    if os.geteuid() != 0:
        return
    entry = pwd.getpwnam(SERVER_USER)
    os.chown(path, entry.pw_uid, entry.pw_gid)


@dataclass
class PrivatePostgres:
    """One server: its port, its data directory and its log."""

    port: int
    directory: Path
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def log(self) -> Path:
        return self.directory / "server.log"

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``: how the daemons' log lines name a database host."""
        return f"127.0.0.1:{self.port}"

    def url(self, database: str = "postgres", user: str = "postgres") -> str:
        return f"postgresql://{user}@{self.address}/{database}"

    # --- life -------------------------------------------------------------------------

    def initialise(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        _hand_to_server_user(self.directory)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "--encoding=UTF8",
            "--locale=C",
        )

    def start(self, **settings: str) -> None:
        """Start the server (settings given here apply to this start only, over those
        the server was made with) and wait until it accepts connections."""
        options = {
            "port": str(self.port),
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": "",
            "fsync": "off",
            "full_page_writes": "off",
            "wal_level": "replica",
            "max_wal_senders": "5",
            "hot_standby": "on",
            **self.settings,
            **settings,
        }
        flags = " ".join(f"-c {name}={value}" for name, value in options.items())
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", flags, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop as an operator would (``fast``: roll back sessions, checkpoint) or as a
        crash would (``immediate``)."""
        if self.running():
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def kill(self) -> None:
        """The primary dies: no checkpoint, no goodbye to its clients or standbys."""
        self.stop(mode="immediate")

    def promote(self) -> None:
        """A standby becomes a writable primary; returns once it accepts writes."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "promote")

    def running(self) -> bool:
        done = subprocess.run(
            [*_as_server_user(), str(self._bin("pg_ctl")), "-D", str(self.data), "status"],
            capture_output=True,
            check=False,
            timeout=COMMAND_SECONDS,
        )
        return done.returncode == 0

    def standby(self, directory: Path, **settings: str) -> PrivatePostgres:
        """A streaming standby of this (running) server, made with ``pg_basebackup -R``
        and not yet started."""
        follower = PrivatePostgres(port=free_port(), directory=directory, settings=dict(settings))
        follower.directory.mkdir(parents=True, exist_ok=True)
        _hand_to_server_user(follower.directory)
        follower._run(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-D",
            str(follower.data),
            "-R",
            "-X",
            "stream",
            "--no-sync",
        )
        return follower

    # --- questions --------------------------------------------------------------------

    def execute(self, sql: str, database: str = "postgres") -> list[tuple[object, ...]]:
        """Run one statement in autocommit and return its rows (none for a command)."""
        with psycopg.connect(self.url(database), autocommit=True, connect_timeout=10) as conn:
            cursor = conn.execute(sql)
            return list(cursor.fetchall()) if cursor.description else []

    def wait_until_accepting_writes(self, deadline_seconds: float = COMMAND_SECONDS) -> None:
        def writable() -> bool:
            with contextlib.suppress(psycopg.Error):
                return self.execute("SELECT pg_is_in_recovery()") == [(False,)]
            return False

        self.wait_for(writable, f"a writable server on {self.address}", deadline_seconds)

    def wait_for(
        self, condition: Callable[[], bool], what: str, deadline_seconds: float = COMMAND_SECONDS
    ) -> None:
        """Poll ``condition`` until it holds; past the deadline, fail with this server's
        log tail (which says why a server did not come up or catch up)."""
        deadline = time.monotonic() + deadline_seconds
        while not condition():
            if time.monotonic() > deadline:
                raise PrivatePostgresError(f"timed out waiting for {what}:\n{self.tail()}")
            time.sleep(POLL_SECONDS)

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # --- plumbing ---------------------------------------------------------------------

    def _bin(self, name: str) -> Path:
        directory = bin_directory()
        if directory is None:
            raise PrivatePostgresError("Postgres is not installed")
        return directory / name

    def _run(self, command: str, *args: str) -> None:
        try:
            done = subprocess.run(
                [*_as_server_user(), str(self._bin(command)), *args],
                capture_output=True,
                text=True,
                timeout=COMMAND_SECONDS,
                check=False,
                cwd=str(self.directory),
            )
        except subprocess.TimeoutExpired as exc:
            raise PrivatePostgresError(f"{command} took over {COMMAND_SECONDS:.0f} s") from exc
        if done.returncode != 0:
            raise PrivatePostgresError(
                f"{command} failed ({done.returncode}): {done.stderr.strip()}\n{self.tail()}"
            )


def _workspace() -> Path:
    path = Path(tempfile.mkdtemp(prefix="outbox_pg_"))
    # The server user must reach its data directory through this one.
    path.chmod(0o755)
    return path


@contextlib.contextmanager
def private_postgres(settings: Mapping[str, str] | None = None) -> Iterator[PrivatePostgres]:
    """A fresh, running server for the block; killed and deleted after it, whatever the
    block did to it."""
    workspace = _workspace()
    server = PrivatePostgres(
        port=free_port(), directory=workspace / "primary", settings=dict(settings or {})
    )
    try:
        server.initialise()
        server.start()
        yield server
    finally:
        with contextlib.suppress(PrivatePostgresError, subprocess.TimeoutExpired):
            server.kill()
        shutil.rmtree(workspace, ignore_errors=True)


@contextlib.contextmanager
def private_workspace() -> Iterator[Path]:
    """A temporary directory the server user can use, for servers made in the block
    (standbys); the caller stops what it started there, the directory goes after."""
    workspace = _workspace()
    try:
        yield workspace
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
