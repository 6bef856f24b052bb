"""effect-outbox on the product's defaults, with one message per operation always, and
with each decision recorded inside a transaction block of the writer's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import psycopg
from psycopg import sql

from bench.e2e_tools import TOOL, build_registry
from bench.reporting import percentile
from bench.systems.base import (
    Close,
    Context,
    Daemon,
    Enqueue,
    count_rows,
    read_effects,
    topology_for,
)
from outbox import RecordedDecision, Settings, record_decision, record_decision_async
from outbox.broker import Topology, delete_topology
from outbox.cli import run_async
from outbox.sandbox.processes import python_module
from outbox.sandbox.scratch import ScratchDatabase


@dataclass
class OutboxSettings:
    """effect-outbox's knobs, as OUTBOX_* variables of the two daemons."""

    consumers: int = 1
    # None: the product's default (OUTBOX_PREFETCH unset), as a user who sets nothing runs.
    prefetch: int | None = None
    batch_size: int = 200
    lanes: int = 2
    log_level: str = "INFO"
    # Dispatcher processes on the one outbox table (their claims SKIP LOCKED each other's).
    dispatchers: int = 1
    # Whether the operation_events trigger notifies outbox_operation_changed (what
    # await_outcome's watcher listens to): the cost of that NOTIFY, measured.
    change_notify: bool = True
    # The most operations per broker message of the "outbox" system (None: the product's
    # default, OUTBOX_MESSAGE_OPERATIONS unset); "outbox-single" always sends one each.
    chunk_operations: int | None = None
    # An ablation, never a product setting: what the database's guards cost, measured by
    # switching them off (strip_guards: "chain", "guards", "checks", "foreign-keys").
    strip: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "chunk_operations": self.chunk_operations or Settings().message_operations,
            "change_notify": self.change_notify,
            "consumer_processes": self.consumers,
            "dispatcher_processes": self.dispatchers,
            "prefetch": self.prefetch or Settings().prefetch,
            "dispatcher_batch_size": self.batch_size,
            "dispatch_lanes": self.lanes,
            # Read from OUTBOX_DISPATCH_GATHER_MS as the daemons read it: the bench sets
            # no value of its own, so a run on another gather says so in its report.
            "dispatch_gather_ms": Settings().dispatch_gather_ms,
            "log_level": self.log_level,
            "event_loop": "uvloop",
            "stripped": list(self.strip),
        }


COMMITTED_EFFECTS = (
    "SELECT operation_id::text, extract(epoch FROM created_at)::float8 "
    "FROM operation_events WHERE name = 'operation.committed'"
)
COMMITTED_COUNT = "SELECT count(*) FROM operation_events WHERE name = 'operation.committed'"
# Where effect-outbox's decision-to-effect time goes, from its own event log: the decision
# commit (operation.prepared), the dispatcher's publish (outbox.published_at), the
# consumer's claim (operation.attempted) and the committed outcome. Each event's time is
# its transaction's start on the database clock; published_at is the mark's clock, once
# the batch's confirms are in.
STAGES_SQL = """
SELECT extract(epoch FROM x.published_at - p.created_at),
       extract(epoch FROM a.created_at - x.published_at),
       extract(epoch FROM c.created_at - a.created_at)
FROM operation_events p
JOIN outbox x ON x.operation_id = p.operation_id
JOIN operation_events a ON a.operation_id = p.operation_id AND a.name = 'operation.attempted'
JOIN operation_events c ON c.operation_id = p.operation_id AND c.name = 'operation.committed'
WHERE p.name = 'operation.prepared'
"""
STAGES = ("decision_to_published", "published_to_claimed", "claimed_to_committed")
CHECK_SQL = """
SELECT count(*), count(*) FILTER (WHERE state = 'committed'),
       count(*) FILTER (WHERE attempts <> 1),
       (SELECT count(*) FROM (SELECT operation_id FROM operation_events
        WHERE name = 'operation.committed' GROUP BY operation_id HAVING count(*) > 1) d)
FROM operations
"""


# The hot path's tables: a decision writes the first three, every transition the
# operation, an event and its head, the dispatcher its outbox row.
HOT_TABLES = ("operations", "operation_events", "operation_event_heads", "outbox")
# The triggers that wake someone are behaviour, not guards: they always stay.
WAKING_TRIGGERS = ("outbox_notify_pending", "operation_events_notify_changed")
CHAIN_TRIGGER = "operation_events_chain"
STRIPPABLE = ("chain", "guards", "checks", "foreign-keys")
HOT_TRIGGERS_SQL = """
SELECT c.relname, t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
WHERE NOT t.tgisinternal AND c.relname = ANY(%(tables)s) AND t.tgname <> ALL(%(waking)s)
  AND c.relnamespace = current_schema()::regnamespace
"""
HOT_CONSTRAINTS_SQL = """
SELECT c.relname, k.conname FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
WHERE k.contype = ANY(%(types)s::"char"[]) AND c.relname = ANY(%(tables)s)
  AND c.relnamespace = current_schema()::regnamespace
"""


def refuse_unknown_strip(strip: tuple[str, ...]) -> None:
    unknown = set(strip) - set(STRIPPABLE)
    if unknown:
        raise ValueError(f"nothing called {sorted(unknown)} to strip; {STRIPPABLE}")


def strip_guards(connection: psycopg.Connection[Any], strip: tuple[str, ...]) -> None:
    """Switch off what ``strip`` names on the hot tables of a bench database: "chain",
    the evidence chain's trigger (an event's seq and hashes then go unfilled); "guards",
    every other trigger but those that wake someone (the birth, transition, outbox-row,
    append-only and by-role checks); "checks", their CHECK constraints; "foreign-keys",
    their FOREIGN KEY constraints. A bench ablation that leaves a database no product
    component should be given."""
    refuse_unknown_strip(strip)
    names = {"tables": list(HOT_TABLES), "waking": list(WAKING_TRIGGERS)}
    for table, trigger in connection.execute(HOT_TRIGGERS_SQL, names).fetchall():
        if ("chain" if trigger == CHAIN_TRIGGER else "guards") not in strip:
            continue
        connection.execute(
            sql.SQL("ALTER TABLE {} DISABLE TRIGGER {}").format(
                sql.Identifier(table), sql.Identifier(trigger)
            )
        )
    if "chain" in strip:
        for column in ("seq", "hash"):
            connection.execute(
                sql.SQL("ALTER TABLE operation_events ALTER COLUMN {} DROP NOT NULL").format(
                    sql.Identifier(column)
                )
            )
    types = [kind for name, kind in (("checks", "c"), ("foreign-keys", "f")) if name in strip]
    if types:
        found = connection.execute(HOT_CONSTRAINTS_SQL, {**names, "types": types}).fetchall()
        for table, constraint in found:
            connection.execute(
                sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
                    sql.Identifier(table), sql.Identifier(constraint)
                )
            )


@dataclass
class Outbox:
    """effect-outbox as deployed: ``python -m dispatcher`` and ``python -m consumer
    --tools bench.e2e_tools`` (a no-op tool) as subprocesses. The effect time is the
    ``operation.committed`` event's timestamp, written by the statement that records the
    outcome."""

    context: Context
    settings: OutboxSettings = field(default_factory=OutboxSettings)
    name: str = "outbox"
    label: str = "effect-outbox"
    uses_broker: bool = True
    in_transaction_block: bool = False
    """Whether the writer wraps each decision in BEGIN and COMMIT (three round trips)
    instead of recording it as a transaction of its own (one)."""

    def database(self) -> ScratchDatabase:
        return self.context.database(self.name, outbox_schema=True)

    def topology(self) -> Topology:
        return topology_for(self.context.names(self.name))

    def set_up(self) -> str:
        refuse_unknown_strip(self.settings.strip)
        url = self.database().recreate()
        if not self.settings.change_notify:
            with psycopg.connect(url) as connection:
                connection.execute(
                    "ALTER TABLE operation_events DISABLE TRIGGER operation_events_notify_changed"
                )
        if self.settings.strip:
            with psycopg.connect(url) as connection:
                strip_guards(connection, self.settings.strip)
        with contextlib.suppress(Exception):
            run_async(delete_topology(self.context.amqp_url, self.topology()))
        return url

    def tear_down(self) -> None:
        with contextlib.suppress(Exception):
            self.database().drop()
        with contextlib.suppress(Exception):
            run_async(delete_topology(self.context.amqp_url, self.topology()))

    @contextlib.contextmanager
    def backlog(self, url: str, count: int) -> Iterator[bool]:
        registry = build_registry()
        with psycopg.connect(url, autocommit=True) as connection, connection.transaction():
            for n in range(count):
                record_decision(
                    connection, registry, TOOL, {"n": n}, run_id="e2e", decision_key=f"k{n}"
                )
            yield True

    async def writer(self, url: str) -> tuple[Enqueue, Close]:
        # By default each decision a transaction of its own, as the peers enqueue: one
        # statement in autocommit, one round trip.
        own = not self.in_transaction_block
        connection = await psycopg.AsyncConnection.connect(url, autocommit=own)
        registry = build_registry()
        run_id = f"e2e_{uuid4().hex[:8]}"

        async def record(n: int) -> RecordedDecision:
            return await record_decision_async(
                connection,
                registry,
                TOOL,
                {"n": n},
                run_id=run_id,
                decision_key=f"k{n}",
                own_transaction=own,
            )

        async def enqueue(n: int) -> str:
            if own:
                return str((await record(n)).operation.id)
            async with connection.transaction():
                return str((await record(n)).operation.id)

        return enqueue, connection.close

    def environment(self, url: str) -> dict[str, str]:
        names = self.topology()
        # What the daemons read from the environment besides, as this process reads it.
        daemon_settings = Settings(
            database_url=url,
            amqp_url=self.context.amqp_url,
            exchange=names.exchange,
            queue=names.queue,
            dead_letter_exchange=names.dead_letter_exchange,
            dead_letter_queue=names.dead_letter_queue,
            tools="bench.e2e_tools",
            # Fresh names per run, declared by the daemons (no `outbox migrate --broker`).
            declare_topology=True,
            prefetch=self.settings.prefetch or Settings().prefetch,
            batch_size=self.settings.batch_size,
            dispatch_lanes=self.settings.lanes,
            message_operations=self.message_operations,
            log_level=self.settings.log_level,
            metrics_host="127.0.0.1",
            metrics_port=0,
        )
        return {**os.environ, **daemon_settings.to_environment()}

    @property
    def message_operations(self) -> int:
        return self.settings.chunk_operations or Settings().message_operations

    def daemons(self, url: str) -> list[list[Daemon]]:
        env = self.environment(url)
        dispatchers = self.settings.dispatchers
        return [
            [
                Daemon(
                    "consumers",
                    f"consumer{n}",
                    python_module("consumer"),
                    "consumer.session_ready",
                    env,
                )
                for n in range(self.settings.consumers)
            ],
            [
                Daemon(
                    "dispatcher",
                    "dispatcher" if dispatchers == 1 else f"dispatcher{n}",
                    python_module("dispatcher"),
                    "dispatcher.session_ready",
                    env,
                )
                for n in range(dispatchers)
            ],
        ]

    def effect_times(self, url: str) -> dict[str, float]:
        return read_effects(url, COMMITTED_EFFECTS)

    def count_effects(self, connection: psycopg.Connection[Any]) -> int:
        return count_rows(connection, COMMITTED_COUNT)

    def check(self, url: str, expected: int) -> list[str]:
        """Every operation committed, exactly one attempt and one committed event each."""
        with psycopg.connect(url, autocommit=True) as connection:
            row = connection.execute(CHECK_SQL).fetchone()
        assert row is not None
        operations, committed, retried, doubled = (int(v) for v in row)
        problems = []
        if (operations, committed) != (expected, expected):
            problems.append(
                f"{committed} of {operations} operations committed, expected {expected}"
            )
        if retried or doubled:
            problems.append(
                f"{retried} operations attempted more than once, {doubled} committed twice"
            )
        return problems

    def stages(self, url: str) -> dict[str, dict[str, float]]:
        """p50 and p99 of each stage in ms (published_at is the mark's clock, after the
        batch's confirms: the publish shows in decision_to_published)."""
        with psycopg.connect(url, autocommit=True) as connection:
            rows = connection.execute(STAGES_SQL).fetchall()
        stages: dict[str, dict[str, float]] = {}
        for index, stage in enumerate(STAGES):
            values = sorted(float(row[index]) for row in rows if row[index] is not None)
            stages[stage] = {
                "p50": round(percentile(values, 0.50) * 1000, 2),
                "p99": round(percentile(values, 0.99) * 1000, 2),
            }
        return stages

    def child(self, role: str, url: str) -> Coroutine[Any, Any, None]:
        raise SystemExit(f"effect-outbox runs its own daemons, no child {role!r}")


@dataclass
class SingleOutbox(Outbox):
    """effect-outbox with one broker message per operation whatever the backlog
    (OUTBOX_MESSAGE_OPERATIONS=1), where ``outbox`` chunks as a backlog forms."""

    name: str = "outbox-single"
    label: str = "effect-outbox, one operation per message"

    @property
    def message_operations(self) -> int:
        return 1


@dataclass
class OutboxInTransaction(Outbox):
    """effect-outbox on its defaults with each decision recorded in a transaction block of
    its writer's (BEGIN, ``record_decision_async``, COMMIT: three round trips), as when it
    commits with the caller's own writes, where ``outbox`` records each as a transaction
    of its own (``own_transaction=True``: one)."""

    name: str = "outbox-in-transaction"
    label: str = "effect-outbox, in a transaction"
    in_transaction_block: bool = True
