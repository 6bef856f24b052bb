"""What every system of the comparison shares: the ``System`` protocol, the run's names
(``Context``), the daemons a system names, and the inbox its effects land in (all but
effect-outbox, which records them as events)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg

from outbox.broker import Topology
from outbox.sandbox.scratch import ScratchDatabase

READY = "e2e.ready"
# The module the children run as: `python -m bench.e2e --child <system>-<role>`.
CHILD_MODULE = "bench.e2e"
INSERT_CHUNK = 500

Enqueue = Callable[[int], Coroutine[Any, Any, str]]
Close = Callable[[], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class Daemon:
    """One process a system runs: its CPU group, name, command, the line it writes when
    ready, and its environment."""

    group: str
    name: str
    argv: list[str]
    ready_line: str
    environment: Mapping[str, str]


@dataclass(frozen=True)
class Context:
    """What every system of one bench run shares: the servers and its run's names."""

    admin_url: str
    amqp_url: str
    run_name: str
    procrastinate_concurrency: int = 1

    def database(self, system: str, *, outbox_schema: bool = False) -> ScratchDatabase:
        return ScratchDatabase(
            self.admin_url, f"e2e_{self.run_name}_{system}", apply_schema=outbox_schema
        )

    def names(self, system: str) -> str:
        return f"bench.e2e.{self.run_name}.{system}"

    def child(self, system: str, role: str, url: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            CHILD_MODULE,
            "--child",
            f"{system}-{role}",
            "--child-url",
            url,
            "--amqp-url",
            self.amqp_url,
            "--child-run",
            self.run_name,
            "--procrastinate-concurrency",
            str(self.procrastinate_concurrency),
        ]


class System(Protocol):
    name: str
    label: str
    # Whether RabbitMQ carries its work (its node is then one of the CPU groups).
    uses_broker: bool

    def set_up(self) -> str:
        """A fresh database with the system's schema (and fresh broker names); its URL."""

    def tear_down(self) -> None:
        """Drop what set_up made, whatever happened."""

    def backlog(self, url: str, count: int) -> contextlib.AbstractContextManager[bool]:
        """``count`` decisions in one transaction that commits when the block ends;
        yields whether it is still pending (False: the system commits on its own)."""

    async def writer(self, url: str) -> tuple[Enqueue, Close]:
        """One decision per call, committed as a transaction of its own (one statement
        in autocommit where the system allows); returns its effect key."""

    def daemons(self, url: str) -> list[list[Daemon]]:
        """The processes that drain it, stage by stage: each stage ready before the next."""

    def effect_times(self, url: str) -> dict[str, float]:
        """Effect key -> epoch seconds of the effect, on the database clock."""

    def count_effects(self, connection: psycopg.Connection[Any]) -> int: ...

    def check(self, url: str, expected: int) -> list[str]:
        """What went wrong beyond a missing effect (lost, doubled, retried)."""

    def stages(self, url: str) -> dict[str, dict[str, float]]:
        """Where decision-to-effect time goes, when the system records it."""

    def child(self, role: str, url: str) -> Coroutine[Any, Any, None]:
        """What a child process of this system runs (``--child <name>-<role>``)."""


def topology_for(names: str) -> Topology:
    return Topology(
        exchange=f"{names}.x",
        queue=f"{names}.q",
        dead_letter_exchange=f"{names}.dlx",
        dead_letter_queue=f"{names}.dlq",
        delivery_limit=5,
    )


def ready_marker() -> None:
    print(READY, file=sys.stderr, flush=True)


def read_effects(url: str, sql: str) -> dict[str, float]:
    """Effect key -> epoch seconds, from a query of (key text, epoch) rows."""
    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(sql).fetchall()
    return {key: float(at) for key, at in rows}


def count_rows(connection: psycopg.Connection[Any], sql: str) -> int:
    row = connection.execute(sql).fetchone()
    return int(row[0]) if row else 0


INBOX_DDL = """
CREATE TABLE inbox (
    key           uuid PRIMARY KEY,
    completed_at  timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
INBOX_EFFECTS = "SELECT key::text, extract(epoch FROM completed_at)::float8 FROM inbox"
INBOX_COUNT = "SELECT count(*) FROM inbox"
INBOX_BATCH = "INSERT INTO inbox (key) SELECT unnest(%s::uuid[]) ON CONFLICT DO NOTHING"


@dataclass
class InboxSystem:
    """What the peers share: an inbox table their handler writes, nothing to check
    beyond the count, no stages, no broker unless they say so."""

    context: Context
    name: str = ""
    label: str = ""
    uses_broker: bool = False

    def database(self) -> ScratchDatabase:
        return self.context.database(self.name)

    def set_up(self) -> str:
        url = self.database().recreate()
        with psycopg.connect(url) as connection:
            connection.execute(INBOX_DDL)
        self.install(url)
        return url

    def install(self, url: str) -> None:
        """The system's own schema, beside the inbox."""

    def tear_down(self) -> None:
        with contextlib.suppress(Exception):
            self.database().drop()

    def effect_times(self, url: str) -> dict[str, float]:
        return read_effects(url, INBOX_EFFECTS)

    def count_effects(self, connection: psycopg.Connection[Any]) -> int:
        return count_rows(connection, INBOX_COUNT)

    def check(self, url: str, expected: int) -> list[str]:
        return []

    def stages(self, url: str) -> dict[str, dict[str, float]]:
        return {}
