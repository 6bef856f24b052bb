"""A primary and a streaming standby of the test's own, for the tests that fail a
database over: the standby is made from the primary with ``pg_basebackup -R``
(:mod:`support.private_postgres`), then the primary is told to wait for it on every
commit (synchronous) or not (asynchronous).

:meth:`ReplicatedPair.fail_over` is what RDS, Patroni or CloudNativePG do when a
primary dies: the primary crashes (``pg_ctl stop -m immediate``) and the standby is
promoted. :meth:`ReplicatedPair.detach_standby` stops the standby's WAL receiver, so
that what the primary commits from then on is provably not replicated: an asynchronous
standby that fell behind, made certain rather than left to chance.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from support.private_postgres import (
    COMMAND_SECONDS,
    PrivatePostgres,
    PrivatePostgresError,
    private_postgres,
    private_workspace,
)


@dataclass(frozen=True)
class Failover:
    """How long each step of :meth:`ReplicatedPair.fail_over` took, in seconds."""

    kill_s: float
    promote_s: float
    killed_at: float
    """``time.monotonic()`` when the primary was dead: the start of the outage."""


@dataclass
class ReplicatedPair:
    primary: PrivatePostgres
    standby: PrivatePostgres
    synchronous: bool

    def url(self, database: str = "postgres", user: str = "postgres") -> str:
        """The libpq multi-host URL a deployment gives its daemons: both servers, and
        only a writable one will do."""
        return (
            f"postgresql://{user}@{self.primary.address},{self.standby.address}/{database}"
            "?target_session_attrs=read-write"
        )

    def wait_replayed(self, deadline_seconds: float = COMMAND_SECONDS) -> None:
        """Wait until the standby has replayed everything the primary wrote so far."""
        (target,) = self.primary.execute("SELECT pg_current_wal_lsn()::text")[0]
        self._wait(
            lambda: (
                self.standby.execute(f"SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn")
                == [(True,)]
            ),
            f"the standby to replay up to {target}",
            deadline_seconds,
        )

    def detach_standby(self) -> None:
        """Stop the standby's WAL receiver (an empty ``primary_conninfo``): it keeps what
        it has and receives nothing more. Asynchronous pairs only: a synchronous primary
        would wait for it on every commit."""
        if self.synchronous:
            raise PrivatePostgresError("a synchronous primary would block without its standby")
        self.standby.execute("ALTER SYSTEM SET primary_conninfo = ''")
        self.standby.execute("SELECT pg_reload_conf()")
        self._wait(
            lambda: self.standby.execute("SELECT count(*) FROM pg_stat_wal_receiver") == [(0,)],
            "the standby's WAL receiver to stop",
        )

    def fail_over(self) -> Failover:
        """Crash the primary and promote the standby; returns once it accepts writes."""
        started = time.monotonic()
        self.primary.kill()
        killed_at = time.monotonic()
        self.standby.promote()
        self.standby.wait_until_accepting_writes()
        return Failover(
            kill_s=killed_at - started,
            promote_s=time.monotonic() - killed_at,
            killed_at=killed_at,
        )

    def _wait(
        self, condition: Callable[[], bool], what: str, deadline_seconds: float = COMMAND_SECONDS
    ) -> None:
        self.standby.wait_for(condition, what, deadline_seconds)


@contextlib.contextmanager
def replicated_pair(*, synchronous: bool) -> Iterator[ReplicatedPair]:
    """A running primary and its streaming standby for the block; both killed and
    deleted after it."""
    with private_postgres() as primary, private_workspace() as workspace:
        standby = primary.standby(workspace / "standby")
        try:
            standby.start()
            pair = ReplicatedPair(primary=primary, standby=standby, synchronous=synchronous)
            pair._wait(
                lambda: primary.execute("SELECT count(*) FROM pg_stat_replication") == [(1,)],
                "the standby to stream from the primary",
            )
            if synchronous:
                # Set after the base backup, so the standby never inherits it: promoted,
                # it would wait on every commit for a standby it does not have.
                primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                primary.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
                primary.execute("SELECT pg_reload_conf()")
                pair._wait(
                    lambda: (
                        primary.execute("SELECT sync_state FROM pg_stat_replication") == [("sync",)]
                    ),
                    "the standby to be synchronous",
                )
            yield pair
        finally:
            with contextlib.suppress(PrivatePostgresError, subprocess.TimeoutExpired):
                standby.kill()
