"""End to end, decision to effect: effect-outbox against the physical limit and its peers.

    .venv/bin/pip install -q -e '.[bench]' && .venv/bin/python bench/e2e.py
        [--operations 5000] [--runs 3] [--rate 500] [--seconds 20] [--systems ...]
    .venv/bin/python bench/e2e.py --scale-out [--scale-consumers 1 2 4]
        [--scale-dispatchers 1 2] [--operations 5000] [--runs 3]

Four systems do the same job on the same Postgres and RabbitMQ, one after another:

- ``minimal``: a hand-written pipeline with no guarantees, the physical limit. A relay
  process claims rows (``FOR UPDATE SKIP LOCKED``, batch 200, LISTEN/NOTIFY), publishes
  them with every confirm outstanding, marks them, commits; a consumer process (prefetch
  500) inserts each burst of deliveries into an inbox table in one statement and acks
  the burst with one ``multiple`` ack. Same quorum queue topology as effect-outbox.
- ``outbox``: effect-outbox as deployed: ``python -m dispatcher`` and ``python -m
  consumer --tools bench.e2e_tools`` (a no-op tool) as subprocesses. The effect time
  is the ``operation.committed`` event's timestamp, written by the statement that
  records the outcome.
- ``pgqueuer``: one worker (asyncpg, library defaults: batch 10) whose no-op handler
  records completion in an inbox table.
- ``procrastinate``: one worker (psycopg pool, ``--procrastinate-concurrency``) whose
  no-op task records completion in an inbox table.

Every process runs on uvloop. Two phases per system:

1. throughput: ``--operations`` decisions/jobs written in one transaction before
   anything runs (not timed), the system's processes started (consumers first, ready,
   then the relay), then the transaction committed and the backlog drained (procrastinate
   defers in transactions of its own: its backlog is committed before its worker starts);
   operations/s = (N - 1) / (last effect - first effect), from the effect timestamps the
   database recorded. ``--runs`` times each: median and spread.
2. latency: the processes running and idle, a writer process commits one decision per
   transaction at ``--rate``/s for ``--seconds`` s (a monotonic schedule, as an agent
   service would); decision-to-effect = effect timestamp (database clock) - the
   writer's wall clock just after its commit returned. Same host, same clock.

Each system gets a database of its own (``e2e_<run>_<system>``, dropped at the end) and
broker names of its own (``bench.e2e.<run>.*``, deleted at the end), on the server of
``--database-url`` (env ``OUTBOX_BENCH_DATABASE_URL``) and ``--amqp-url`` (env
``OUTBOX_BENCH_AMQP_URL``). A table on stdout; every figure, settings and the environment
in ``bench/results/e2e.json``. Exits 1 when a check failed (an operation lost, effected
twice, or a phase aborted); a broker restarted by someone else aborts that phase only.
``--py-spy DIR`` also records the effect-outbox daemons with py-spy during their first
throughput run (needs ptrace rights, e.g. root).

CPU budget: over each measured window (a drain: from the backlog's commit, every process
ready and idle, to the poll that sees the last effect; latency: from the writer's start
to the last effect) the CPU milliseconds per operation of each process group, from
``/proc`` (``bench/cpu.py``): the writer (latency only; it reads its own), the
dispatcher or relay, the consumers or workers, the Postgres server's processes, the
RabbitMQ node's (the systems that use it); ``cpu`` in each run's JSON,
``cpu_ms_per_op`` per system (the drain's median run, and the latency window),
``cpu_ratios``.

``--scale-out``: effect-outbox's drain alone, for each count of consumer processes
(``--scale-consumers``) times dispatcher processes (``--scale-dispatchers``), operations/s
and the CPU budget; JSON in ``bench/results/e2e_scale_out.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit
from uuid import UUID, uuid4

import aio_pika
import psycopg

# Run as a script, this file's directory is sys.path[0], and bench/dispatcher.py would
# shadow the dispatcher package: drop it. The repository root (on sys.path through the
# editable install) makes this directory importable as the namespace package `bench`.
sys.path.remove(str(Path(__file__).resolve().parent))

from bench.cpu import (
    CLOCK_TICKS,
    TOTAL,
    AnyOf,
    Named,
    Pids,
    ProcessGroups,
    Selector,
    Usage,
    cpu_seconds,
    listening_sockets,
    read_stat,
    scan,
    socket_owners,
)
from bench.e2e_tools import TOOL, build_registry
from bench.reporting import json_safe, percentile
from outbox import Settings, record_decision, record_decision_async
from outbox.broker import Topology, declare_topology, delete_topology
from outbox.cli import positive_int, run_async
from outbox.sandbox.processes import DaemonProcess, python_module, stop_all
from outbox.sandbox.scratch import ScratchDatabase
from outbox.settings import libpq_url

T = TypeVar("T")

SCRIPT = str(Path(__file__).resolve())
REPOSITORY = Path(__file__).resolve().parents[1]
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "e2e.json"
DEFAULT_SCALE_OUT_JSON = Path(__file__).resolve().parent / "results" / "e2e_scale_out.json"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
SYSTEMS = ("minimal", "outbox", "pgqueuer", "procrastinate")
BROKER_SYSTEMS = ("minimal", "outbox")  # pgqueuer and procrastinate use Postgres alone
LABELS = {
    "minimal": "minimal pipeline (no guarantees)",
    "outbox": "effect-outbox",
    "pgqueuer": "pgqueuer",
    "procrastinate": "procrastinate",
}
READY = "e2e.ready"
# The CPU budget's process groups: the writer (in the latency window only: the throughput
# backlog is written before its window), the dispatcher (the minimal pipeline's relay;
# pgqueuer and procrastinate have none), the consumers (the peers' workers), every
# process of the Postgres server and of the RabbitMQ node.
CPU_GROUPS = ("writer", "dispatcher", "consumers", "postgres", "rabbitmq")
# The RabbitMQ nodes on this machine (not the Erlang VMs that rabbitmqctl runs), and their
# port mapper.
RABBITMQ_NODES = Named(frozenset({"beam.smp"}), arguments=("rabbit", "boot"))
EPMD = Named(frozenset({"epmd"}))
POSTGRES_PROCESSES = frozenset({"postgres", "postmaster"})
INSERT_CHUNK = 500
MINIMAL_BATCH = 200
MINIMAL_PREFETCH = 500
LATE_AFTER = 0.010  # a decision written this far behind its schedule counts as late
SETTLE_SECONDS = 60.0
PACKAGES = (
    "aio-pika",
    "aiormq",
    "psycopg",
    "uvloop",
    "asyncpg",
    "pgqueuer",
    "procrastinate",
)  # after the writer stops, how long effects may still take


# --- per-system schema -----------------------------------------------------------------

INBOX_DDL = """
CREATE TABLE inbox (
    key           uuid PRIMARY KEY,
    completed_at  timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

MINIMAL_DDL = """
CREATE TABLE mini_outbox (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key           uuid NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at  timestamptz
);
CREATE INDEX mini_outbox_pending ON mini_outbox (id) WHERE published_at IS NULL;
CREATE FUNCTION mini_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('mini_pending', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER mini_notify AFTER INSERT ON mini_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION mini_notify();
"""

MINIMAL_CLAIM = """
SELECT id, key FROM mini_outbox
WHERE published_at IS NULL
ORDER BY id
LIMIT %s
FOR UPDATE SKIP LOCKED
"""
MINIMAL_MARK = "UPDATE mini_outbox SET published_at = clock_timestamp() WHERE id = ANY(%s)"
INBOX_BATCH = "INSERT INTO inbox (key) SELECT unnest(%s::uuid[]) ON CONFLICT DO NOTHING"

EFFECTS_SQL = {
    "outbox": "SELECT operation_id::text, extract(epoch FROM created_at)::float8 "
    "FROM operation_events WHERE name = 'operation.committed'",
    "inbox": "SELECT key::text, extract(epoch FROM completed_at)::float8 FROM inbox",
}
COUNT_SQL = {
    "outbox": "SELECT count(*) FROM operation_events WHERE name = 'operation.committed'",
    "inbox": "SELECT count(*) FROM inbox",
}


def effect_table(system: str) -> str:
    return "outbox" if system == "outbox" else "inbox"


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """uvloop, as the daemons run (outbox.cli.run_async)."""
    return run_async(main)


def ready_marker() -> None:
    print(READY, file=sys.stderr, flush=True)


def topology_for(names: str) -> Topology:
    return Topology(
        exchange=f"{names}.x",
        queue=f"{names}.q",
        dead_letter_exchange=f"{names}.dlx",
        dead_letter_queue=f"{names}.dlq",
        delivery_limit=5,
    )


# --- children: the minimal pipeline --------------------------------------------------


async def minimal_relay(url: str, amqp_url: str, names: str) -> None:
    """Claim, publish with every confirm outstanding, mark, commit; woken by NOTIFY."""
    topology = topology_for(names)
    listener = await psycopg.AsyncConnection.connect(url, autocommit=True)
    await listener.execute("LISTEN mini_pending")
    database = await psycopg.AsyncConnection.connect(url)
    connection = await aio_pika.connect(amqp_url, timeout=10)
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    await declare_topology(channel, topology)
    raw = await channel.get_underlay_channel()
    wake = asyncio.Event()

    async def forward() -> None:
        async for _ in listener.notifies():
            wake.set()

    forwarding = asyncio.create_task(forward())
    properties = aio_pika.Message(b"", delivery_mode=aio_pika.DeliveryMode.PERSISTENT).properties
    ready_marker()
    while not forwarding.done():
        wake.clear()
        while True:
            async with database.transaction():
                cursor = await database.execute(MINIMAL_CLAIM, (MINIMAL_BATCH,))
                rows = await cursor.fetchall()
                if rows:
                    await asyncio.gather(
                        *(
                            raw.basic_publish(
                                str(key).encode(),
                                exchange=topology.exchange,
                                routing_key="noop.v1",
                                properties=properties,
                                mandatory=True,
                            )
                            for _, key in rows
                        )
                    )
                    await database.execute(MINIMAL_MARK, ([row_id for row_id, _ in rows],))
            if len(rows) < MINIMAL_BATCH:
                break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=1.0)
    forwarding.result()


async def minimal_consumer(url: str, amqp_url: str, names: str) -> None:
    """Deliveries into the inbox in bursts: one INSERT and one multiple-ack per burst.

    Flushes run one at a time and each takes everything delivered so far, so every
    delivery tag up to the burst's last one is in this burst or an earlier, committed
    one: the multiple-ack never acks an uncommitted delivery.
    """
    topology = topology_for(names)
    database = await psycopg.AsyncConnection.connect(url)
    connection = await aio_pika.connect(amqp_url, timeout=10)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=MINIMAL_PREFETCH)
    declared = await declare_topology(channel, topology)
    pending: list[aio_pika.abc.AbstractIncomingMessage] = []
    flushing: list[asyncio.Task[None]] = []

    async def flush() -> None:
        while pending:
            burst = pending[:]
            pending.clear()
            async with database.transaction():
                await database.execute(INBOX_BATCH, ([UUID(m.body.decode()) for m in burst],))
            await burst[-1].ack(multiple=True)

    ready_marker()
    async with declared.queue.iterator() as deliveries:
        async for message in deliveries:
            pending.append(message)
            if not flushing or flushing[0].done():
                if flushing:
                    flushing.pop().result()
                flushing.append(asyncio.create_task(flush()))


# --- children: pgqueuer and procrastinate --------------------------------------------


async def pgqueuer_worker(url: str) -> None:
    import asyncpg  # type: ignore[import-untyped]
    from pgqueuer import PgQueuer
    from pgqueuer.models import Job

    connection = await asyncpg.connect(url)
    pool = await asyncpg.create_pool(url, min_size=2, max_size=10)
    pgq = PgQueuer.from_asyncpg_connection(connection)

    @pgq.entrypoint("noop")
    async def noop(job: Job) -> None:
        assert job.payload is not None
        await pool.execute(
            "INSERT INTO inbox (key) VALUES ($1) ON CONFLICT DO NOTHING", UUID(bytes=job.payload)
        )

    ready_marker()
    await pgq.run()


def procrastinate_app(url: str) -> Any:
    import procrastinate

    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))


async def procrastinate_worker(url: str, concurrency: int) -> None:
    app = procrastinate_app(url)

    @app.task(name="noop")  # type: ignore[untyped-decorator]
    async def noop(key: str) -> None:
        await app.connector.execute_query_async(
            "INSERT INTO inbox (key) VALUES (%(key)s::uuid) ON CONFLICT DO NOTHING", key=key
        )

    async with app.open_async():
        ready_marker()
        await app.run_worker_async(concurrency=concurrency)


# --- children: the paced writer ------------------------------------------------------


async def write_at_rate(system: str, url: str, rate: float, seconds: float) -> dict[str, Any]:
    """One decision (job) per transaction on a monotonic schedule.

    Returns {"commits": {key: wall clock after commit}, "achieved_per_s", "cpu_seconds",
    "late"}."""
    commits: dict[str, float] = {}
    total = max(1, round(rate * seconds))
    enqueue, close = await writer_for(system, url)
    late, worst = 0, 0.0
    try:
        # The writer's CPU over its schedule only (not its start-up): this process and
        # anything below it, read from /proc as the parent reads the daemons'.
        cpu_began = cpu_seconds([os.getpid()])
        began = time.monotonic()
        for n in range(total):
            due = began + n / rate
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            elif now - due > LATE_AFTER:
                late += 1
                worst = max(worst, now - due)
            key = await enqueue(n)
            commits[key] = time.time()
        elapsed = time.monotonic() - began
        cpu = cpu_seconds([os.getpid()]) - cpu_began
    finally:
        await close()
    return {
        "commits": commits,
        "achieved_per_s": total / elapsed,
        "cpu_seconds": cpu,
        "late": {f"over_{LATE_AFTER * 1000:g}ms": late, "worst_ms": round(worst * 1000, 3)},
    }


Enqueue = Callable[[int], Coroutine[Any, Any, str]]
Close = Callable[[], Coroutine[Any, Any, None]]


async def writer_for(system: str, url: str) -> tuple[Enqueue, Close]:
    """How each system's user commits one decision in a transaction of their own."""
    if system in ("minimal", "outbox"):
        connection = await psycopg.AsyncConnection.connect(url)
        registry = build_registry()
        run_id = f"e2e_{uuid4().hex[:8]}"

        async def enqueue(n: int) -> str:
            async with connection.transaction():
                if system == "outbox":
                    recorded = await record_decision_async(
                        connection, registry, TOOL, {"n": n}, run_id=run_id, decision_key=f"k{n}"
                    )
                    return str(recorded.operation.id)
                key = uuid4()
                await connection.execute("INSERT INTO mini_outbox (key) VALUES (%s)", (key,))
                return str(key)

        return enqueue, connection.close
    if system == "pgqueuer":
        import asyncpg
        from pgqueuer import Queries

        pg = await asyncpg.connect(url)
        queries = Queries.from_asyncpg_connection(pg)

        async def enqueue_pgqueuer(n: int) -> str:
            key = uuid4()
            async with pg.transaction():
                await queries.enqueue("noop", key.bytes)
            return str(key)

        return enqueue_pgqueuer, pg.close
    app = procrastinate_app(url)
    await app.open_async()
    task = app.configure_task("noop")

    async def enqueue_procrastinate(n: int) -> str:
        # procrastinate defers on its own pooled connection, in a transaction of its own.
        key = uuid4()
        await task.defer_async(key=str(key))
        return str(key)

    return enqueue_procrastinate, app.close_async


# --- setup and backlog (parent) ------------------------------------------------------


def recreate_database(database: ScratchDatabase, system: str) -> None:
    """Drop and create the system's database; the outbox schema comes with it, the
    others' schemas are installed here."""
    url = database.recreate()
    if system == "outbox":
        return
    with psycopg.connect(url) as connection:
        connection.execute(INBOX_DDL)
        if system == "minimal":
            connection.execute(MINIMAL_DDL)
    if system == "pgqueuer":
        run_loop(install_pgqueuer(url))
    elif system == "procrastinate":
        run_loop(install_procrastinate(url))


async def install_pgqueuer(url: str) -> None:
    import asyncpg
    from pgqueuer import Queries

    connection = await asyncpg.connect(url)
    try:
        await Queries.from_asyncpg_connection(connection).install()
    finally:
        await connection.close()


async def install_procrastinate(url: str) -> None:
    app = procrastinate_app(url)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


@contextlib.contextmanager
def pending_backlog(system: str, url: str, count: int) -> Iterator[bool]:
    """The system's backlog of ``count`` operations, written as its users would write
    them, in one transaction that commits when the block ends: the drain cannot begin
    before the CPU window opens (and the daemons start up with nothing visible to take).
    Yields whether it is pending so; procrastinate defers on its own pool, each batch in
    a transaction of its own, so its backlog is committed at once (False)."""
    if system == "procrastinate":
        run_loop(backlog_procrastinate(url, count))
        yield False
        return
    # Autocommit, with an explicit transaction: what pgqueuer's synchronous driver needs.
    with psycopg.connect(url, autocommit=True) as connection, connection.transaction():
        if system == "outbox":
            registry = build_registry()
            for n in range(count):
                record_decision(
                    connection, registry, TOOL, {"n": n}, run_id="e2e", decision_key=f"k{n}"
                )
        elif system == "minimal":
            connection.execute(
                "INSERT INTO mini_outbox (key) "
                "SELECT gen_random_uuid() FROM generate_series(1, %s)",
                (count,),
            )
        else:
            from pgqueuer.adapters.drivers.psycopg import SyncPsycopgDriver
            from pgqueuer.queries import SyncQueries

            queries = SyncQueries(SyncPsycopgDriver(connection))
            for begin in range(0, count, INSERT_CHUNK):
                size = min(INSERT_CHUNK, count - begin)
                queries.enqueue(["noop"] * size, [uuid4().bytes for _ in range(size)], [0] * size)
        yield True


async def backlog_procrastinate(url: str, count: int) -> None:
    app = procrastinate_app(url)
    async with app.open_async():
        task = app.configure_task("noop")
        for start in range(0, count, INSERT_CHUNK):
            size = min(INSERT_CHUNK, count - start)
            await task.batch_defer_async(*({"key": str(uuid4())} for _ in range(size)))


# --- processes (parent) --------------------------------------------------------------


@dataclass
class OutboxSettings:
    """effect-outbox's knobs, as OUTBOX_* variables of the two daemons."""

    consumers: int
    prefetch: int
    batch_size: int
    lanes: int
    log_level: str
    # Dispatcher processes on the one outbox table (their claims SKIP LOCKED each other's).
    dispatchers: int = 1
    # Whether the operation_events trigger notifies outbox_operation_changed (what
    # await_outcome's watcher listens to): the cost of that NOTIFY, measured.
    change_notify: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "change_notify": self.change_notify,
            "consumer_processes": self.consumers,
            "dispatcher_processes": self.dispatchers,
            "prefetch": self.prefetch,
            "dispatcher_batch_size": self.batch_size,
            "dispatch_lanes": self.lanes,
            "log_level": self.log_level,
            "event_loop": "uvloop",
        }


@dataclass
class Bench:
    admin_url: str
    amqp_url: str
    run_name: str
    outbox: OutboxSettings
    procrastinate_concurrency: int
    logs: Path
    # The Postgres server's processes: its postmaster (found from a backend of ours) and
    # everything below it, or, if that is not visible here, every process so named.
    postgres: Selector = field(default_factory=lambda: Named(POSTGRES_PROCESSES))
    # The RabbitMQ node that listens on --amqp-url's port, with epmd.
    rabbitmq: Selector = field(default_factory=lambda: AnyOf((RABBITMQ_NODES, EPMD)))
    failures: list[str] = field(default_factory=list)
    spawned: int = 0

    def database(self, system: str) -> ScratchDatabase:
        # The outbox schema for effect-outbox; the others install their own.
        return ScratchDatabase(
            self.admin_url, f"e2e_{self.run_name}_{system}", apply_schema=system == "outbox"
        )

    def names(self, system: str) -> str:
        return f"bench.e2e.{self.run_name}.{system}"

    def fresh(self, system: str) -> str:
        database = self.database(system)
        recreate_database(database, system)
        if system == "outbox" and not self.outbox.change_notify:
            with psycopg.connect(database.url) as connection:
                connection.execute(
                    "ALTER TABLE operation_events DISABLE TRIGGER operation_events_notify_changed"
                )
        if system in BROKER_SYSTEMS:
            with contextlib.suppress(Exception):
                run_loop(delete_topology(self.amqp_url, topology_for(self.names(system))))
        return database.url

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> DaemonProcess:
        self.spawned += 1
        log = self.logs / f"{self.spawned:03d}-{name}.log"
        return DaemonProcess(argv, environment=env, log=log, cwd=REPOSITORY, name=name)

    def outbox_env(self, url: str) -> dict[str, str]:
        names = topology_for(self.names("outbox"))
        # What the daemons read from the environment besides, as this process reads it.
        daemon_settings = Settings(
            database_url=url,
            amqp_url=self.amqp_url,
            exchange=names.exchange,
            queue=names.queue,
            dead_letter_exchange=names.dead_letter_exchange,
            dead_letter_queue=names.dead_letter_queue,
            tools="bench.e2e_tools",
            # Fresh names per run, declared by the daemons (no `outbox migrate --broker`).
            declare_topology=True,
            prefetch=self.outbox.prefetch,
            batch_size=self.outbox.batch_size,
            dispatch_lanes=self.outbox.lanes,
            log_level=self.outbox.log_level,
            metrics_host="127.0.0.1",
            metrics_port=0,
        )
        return {**os.environ, **daemon_settings.to_environment()}

    def child_argv(self, role: str, url: str, system: str) -> list[str]:
        return [
            sys.executable,
            SCRIPT,
            "--child",
            role,
            "--child-url",
            url,
            "--amqp-url",
            self.amqp_url,
            "--child-names",
            self.names(system),
            "--procrastinate-concurrency",
            str(self.procrastinate_concurrency),
        ]

    @contextlib.contextmanager
    def running(self, system: str, url: str) -> Iterator[Running]:
        """The system's processes, consumers ready before the relay starts; stopped
        (SIGTERM, then SIGKILL) on the way out."""
        # (CPU group, name, command, ready line, environment), stage by stage.
        stages: list[list[tuple[str, str, list[str], str, dict[str, str]]]]
        if system == "outbox":
            env = self.outbox_env(url)
            dispatchers = self.outbox.dispatchers
            stages = [
                [
                    (
                        "consumers",
                        f"consumer{n}",
                        python_module("consumer"),
                        "consumer.session_ready",
                        env,
                    )
                    for n in range(self.outbox.consumers)
                ],
                [
                    (
                        "dispatcher",
                        "dispatcher" if dispatchers == 1 else f"dispatcher{n}",
                        python_module("dispatcher"),
                        "dispatcher.session_ready",
                        env,
                    )
                    for n in range(dispatchers)
                ],
            ]
        elif system == "minimal":
            env = dict(os.environ)
            consumer = self.child_argv("minimal-consumer", url, system)
            relay = self.child_argv("minimal-relay", url, system)
            stages = [
                [("consumers", "consumer", consumer, READY, env)],
                [("dispatcher", "relay", relay, READY, env)],
            ]
        else:
            env = dict(os.environ)
            worker = self.child_argv(f"{system}-worker", url, system)
            stages = [[("consumers", "worker", worker, READY, env)]]
        running = Running()
        try:
            for stage in stages:
                started = [
                    (group, self.spawn(f"{system}-{name}", argv, env), marker)
                    for group, name, argv, marker, env in stage
                ]
                for group, child, _ in started:
                    running.add(group, child)
                wait_ready([(child, marker) for _, child, marker in started])
            yield running
        finally:
            stop_all(running.children)

    def process_groups(self, system: str, running: Running) -> ProcessGroups:
        """The CPU groups of a window: the system's daemons, Postgres, and RabbitMQ for
        the systems that use it (the writer, when in the window, measures itself)."""
        groups: dict[str, Selector] = {
            group: Pids(tuple(child.pid for child in children))
            for group, children in running.groups.items()
        }
        groups["postgres"] = self.postgres
        if system in BROKER_SYSTEMS:
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


def count_effects(connection: psycopg.Connection[Any], system: str) -> int:
    row = connection.execute(COUNT_SQL[effect_table(system)]).fetchone()
    return int(row[0]) if row else 0


def effect_times(url: str, system: str) -> dict[str, float]:
    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(EFFECTS_SQL[effect_table(system)]).fetchall()
    return {key: float(at) for key, at in rows}


def check_outbox(url: str, expected: int) -> list[str]:
    """Every operation committed, exactly one attempt and one committed event each."""
    with psycopg.connect(url, autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*), count(*) FILTER (WHERE state = 'committed'), "
            "count(*) FILTER (WHERE attempts <> 1), "
            "(SELECT count(*) FROM (SELECT operation_id FROM operation_events "
            " WHERE name = 'operation.committed' GROUP BY operation_id HAVING count(*) > 1) d) "
            "FROM operations"
        ).fetchone()
    assert row is not None
    operations, committed, retried, doubled = (int(v) for v in row)
    problems = []
    if (operations, committed) != (expected, expected):
        problems.append(f"{committed} of {operations} operations committed, expected {expected}")
    if retried or doubled:
        problems.append(f"{retried} operations attempted more than once, {doubled} committed twice")
    return problems


# Where effect-outbox's decision-to-effect time goes, from its own event log: the decision
# commit (operation.prepared), the dispatcher's publish (outbox.published_at), the
# consumer's claim (operation.attempted) and the committed outcome. Each timestamp is
# its transaction's start on the database clock.
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


def outbox_stages(url: str) -> dict[str, dict[str, float]]:
    """p50 and p99 of each stage in ms (published_at is the mark's transaction start, so
    the broker hop shows in published_to_claimed)."""
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


def wait_for_effects(
    connection: psycopg.Connection[Any], system: str, expected: int, within: float
) -> int:
    """Effects recorded, polled on one open connection (a connection per poll would
    fork a backend each time, Postgres CPU inside the measured window)."""
    deadline = time.monotonic() + within
    done = count_effects(connection, system)
    while done < expected and time.monotonic() < deadline:
        time.sleep(0.2)
        done = count_effects(connection, system)
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


# --- phases (parent) -----------------------------------------------------------------


def throughput(bench: Bench, system: str, count: int, py_spy: Path | None) -> dict[str, Any]:
    url = bench.fresh(system)
    profilers: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        began = time.monotonic()
        backlog = stack.enter_context(contextlib.ExitStack())
        held = backlog.enter_context(pending_backlog(system, url, count))
        inserted = time.monotonic() - began
        running = stack.enter_context(bench.running(system, url))
        watch = stack.enter_context(psycopg.connect(url, autocommit=True))
        if py_spy is not None:
            profilers = start_py_spy(running.children, py_spy)
        # The CPU window: every process ready and idle, from the backlog's commit to the
        # poll that sees the last effect. (procrastinate's backlog is committed already:
        # its worker drains from its start, and what it did before this is left out,
        # with the effects recorded by then.)
        groups = bench.process_groups(system, running)
        start = groups.snapshot()
        before = count_effects(watch, system)
        backlog.close()  # commits
        done = wait_for_effects(watch, system, count, within=max(60.0, count / 50))
        end = groups.snapshot()
        for profiler in profilers:
            profiler.send_signal(signal.SIGINT)
        for profiler in profilers:
            profiler.wait(timeout=60)
    times = sorted(effect_times(url, system).values())
    problems = [] if done == count else [f"{done} of {count} effects recorded"]
    if system == "outbox":
        problems += check_outbox(url, count)
    span = times[-1] - times[0] if len(times) > 1 else math.nan
    return {
        "operations": count,
        "effects": len(times),
        "seconds": span,
        "per_s": (len(times) - 1) / span if span and span > 0 else math.nan,
        "backlog_insert_seconds": inserted,
        "backlog_committed_in_window": held,
        "cpu": cpu_budget(groups.delta(start, end), done - before),
        "py_spy": bool(profilers),
        "failures": [f"{system} throughput: {p}" for p in problems],
    }


def start_py_spy(
    children: Sequence[DaemonProcess], directory: Path
) -> list[subprocess.Popen[bytes]]:
    directory.mkdir(parents=True, exist_ok=True)
    py_spy = Path(sys.executable).parent / "py-spy"
    profilers = []
    for child in children:
        for fmt, suffix in (("raw", "txt"),):
            profilers.append(
                subprocess.Popen(  # noqa: S603 - the venv's py-spy, fixed arguments
                    [
                        str(py_spy),
                        "record",
                        "--pid",
                        str(child.pid),
                        "--rate",
                        "200",
                        "--nonblocking",
                        "--format",
                        fmt,
                        "--output",
                        str(directory / f"{child.name}.{suffix}"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    return profilers


def latency(bench: Bench, system: str, rate: float, seconds: float) -> dict[str, Any]:
    url = bench.fresh(system)
    with (
        bench.running(system, url) as running,
        psycopg.connect(url, autocommit=True) as watch,
    ):
        time.sleep(0.5)  # let the freshly started consumers settle on their queue
        # The CPU window: from the writer's start to the poll that sees the last effect.
        groups = bench.process_groups(system, running)
        start = groups.snapshot()
        before = count_effects(watch, system)
        writer = subprocess.run(  # noqa: S603 - this interpreter, fixed arguments
            [
                sys.executable,
                SCRIPT,
                "--child",
                f"{system}-writer",
                "--child-url",
                url,
                "--rate",
                repr(rate),
                "--seconds",
                repr(seconds),
            ],
            cwd=REPOSITORY,
            capture_output=True,
            check=False,
        )
        if writer.returncode != 0:
            raise RuntimeError(f"the writer failed:\n{writer.stderr.decode()[-2000:]}")
        written = json.loads(writer.stdout)
        commits: dict[str, float] = written["commits"]
        done = wait_for_effects(watch, system, len(commits), within=SETTLE_SECONDS)
        usage = groups.delta(start, groups.snapshot())
    # The writer exited inside the window (its parent, this process, reaped it): it
    # measured its own schedule's CPU.
    usage.cpu["writer"] = float(written["cpu_seconds"])
    effects = effect_times(url, system)
    latencies = sorted(effects[key] - at for key, at in commits.items() if key in effects)
    problems = [] if done >= len(commits) else [f"{len(commits) - done} effects missing"]
    stages: dict[str, dict[str, float]] = {}
    if system == "outbox":
        problems += check_outbox(url, len(commits))
        stages = outbox_stages(url)

    def ms(value: float) -> float:
        return round(value * 1000, 2)

    return {
        "offered_per_s": rate,
        "seconds": seconds,
        "decisions": len(commits),
        "achieved_per_s": written["achieved_per_s"],
        "writer_late": written["late"],
        "effects": len(latencies),
        "decision_to_effect_ms": {
            "p50": ms(percentile(latencies, 0.50)),
            "p90": ms(percentile(latencies, 0.90)),
            "p99": ms(percentile(latencies, 0.99)),
            "max": ms(latencies[-1]) if latencies else math.nan,
            "min": ms(latencies[0]) if latencies else math.nan,
        },
        "stages_ms": stages,
        "cpu": cpu_budget(usage, done - before),
        "failures": [f"{system} latency: {p}" for p in problems],
    }


def run_phase(name: str, failures: list[str], phase: Callable[[], T]) -> T | None:
    """One phase; one that dies (the broker restarted under it, say) is a failure and
    the phases after it still run."""
    try:
        return phase()
    except Exception as error:
        failures.append(f"{name}: aborted by {type(error).__name__}: {error}")
        print(f"FAILED: {failures[-1]}", flush=True)
        return None


# --- report --------------------------------------------------------------------------


def summarize_throughput(entry: dict[str, Any]) -> None:
    """Median and spread of the runs' operations/s; the CPU budget of the run whose
    total CPU per operation is the median (lower middle of an even count), so that its
    groups add up to its total."""
    rates = [run["per_s"] for run in entry["throughput"] if not math.isnan(run["per_s"])]
    if rates:
        entry["per_s_median"] = statistics.median(rates)
        entry["per_s_min"] = min(rates)
        entry["per_s_max"] = max(rates)
    else:
        entry["per_s_median"] = math.nan
    runs = entry["throughput"]
    measured = sorted(
        (
            index
            for index, run in enumerate(runs)
            if not math.isnan(run["cpu"]["cpu_ms_per_op"][TOTAL])
        ),
        key=lambda index: runs[index]["cpu"]["cpu_ms_per_op"][TOTAL],
    )
    median = measured[(len(measured) - 1) // 2] if measured else None
    entry["cpu_median_run"] = median
    cpu = entry.setdefault("cpu_ms_per_op", {})
    cpu["throughput"] = runs[median]["cpu"]["cpu_ms_per_op"] if median is not None else {}


def summarize(results: dict[str, Any]) -> None:
    for entry in results["systems"].values():
        summarize_throughput(entry)
        if entry.get("latency"):
            entry["cpu_ms_per_op"]["latency"] = entry["latency"]["cpu"]["cpu_ms_per_op"]
    median = {s: e["per_s_median"] for s, e in results["systems"].items()}
    pairs = [(system, "minimal") for system in results["systems"] if system != "minimal"]
    pairs += [("outbox", peer) for peer in ("pgqueuer", "procrastinate")]
    pairs = [(a, b) for a, b in pairs if a in results["systems"] and b in results["systems"]]
    results["ratios"] = {f"{a}/{b}": median[a] / median[b] for a, b in pairs}
    # CPU per operation, the same pairs: how many times the CPU the other spends.
    cpu_ratios: dict[str, dict[str, float]] = {}
    for a, b in pairs:
        mine, theirs = (results["systems"][s]["cpu_ms_per_op"] for s in (a, b))
        cpu_ratios[f"{a}/{b}"] = {
            phase: mine[phase][TOTAL] / theirs[phase][TOTAL]
            for phase in ("throughput", "latency")
            if mine.get(phase) and theirs.get(phase) and theirs[phase][TOTAL] > 0
        }
    results["cpu_ratios"] = cpu_ratios


def table(results: dict[str, Any]) -> str:
    lines = [("system", "operations/s, median (runs)", "decision->effect @rate: p50 / p99 / max")]
    for system, entry in results["systems"].items():
        runs = ", ".join(f"{run['per_s']:,.0f}" for run in entry["throughput"])
        rate = f"{entry['per_s_median']:,.0f} ({runs})" if entry["throughput"] else "-"
        late = entry.get("latency")
        if late:
            figures = late["decision_to_effect_ms"]
            lat = (
                f"{figures['p50']:,.1f} / {figures['p99']:,.1f} / {figures['max']:,.1f} ms "
                f"@{late['achieved_per_s']:,.0f}/s ({late['effects']:,}/{late['decisions']:,})"
            )
        else:
            lat = "-"
        lines.append((LABELS[system], rate, lat))
    widths = [max(len(line[i]) for line in lines) + 3 for i in range(2)]
    out = [f"{a:<{widths[0]}}{b:<{widths[1]}}{c}" for a, b, c in lines]
    stages = (results["systems"].get("outbox", {}).get("latency") or {}).get("stages_ms")
    if stages:
        out.append("")
        out.append(
            "effect-outbox stages @rate, p50 / p99: "
            + ", ".join(
                f"{name} {v['p50']:,.1f} / {v['p99']:,.1f} ms" for name, v in stages.items()
            )
        )
    out.append("")
    for name, ratio in results["ratios"].items():
        left, right = name.split("/")
        out.append(f"{LABELS[left]} / {LABELS[right]}: {ratio:.2f}x")
    out += ["", *cpu_table(results)]
    return "\n".join(out)


PHASES = {"throughput": "drain", "latency": "@rate"}


def ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def columns(lines: Sequence[Sequence[str]], left: set[int]) -> list[str]:
    """Lines of cells in columns three spaces apart: text to the left, figures to the right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return [
        "   ".join(
            cell.ljust(widths[i]) if i in left else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        ).rstrip()
        for line in lines
    ]


def cpu_table(results: dict[str, Any]) -> list[str]:
    """CPU ms per operation by group: the drain's median run, and the latency window."""
    header = ("system", "phase", "total", *CPU_GROUPS, "cores busy")
    lines: list[tuple[str, ...]] = [header]
    for system, entry in results["systems"].items():
        median = entry.get("cpu_median_run")
        runs = {
            "throughput": None if median is None else entry["throughput"][median]["cpu"],
            "latency": (entry.get("latency") or {}).get("cpu"),
        }
        label = LABELS[system]
        for phase, budget in runs.items():
            if budget is None:
                continue
            per_op = budget["cpu_ms_per_op"]
            lines.append(
                (
                    label,
                    PHASES[phase],
                    ms(per_op[TOTAL]),
                    *(ms(per_op.get(group)) for group in CPU_GROUPS),
                    f"{budget['cores_busy']:.2f}",
                )
            )
            label = ""
    out = [
        "CPU ms per operation, /proc utime+stime (drain: the median run by total; "
        "@rate: the latency window)",
        *columns(lines, left={0, 1}),
    ]
    for name, phases in results.get("cpu_ratios", {}).items():
        left, right = name.split("/")
        figures = ", ".join(f"{PHASES[phase]} {ratio:.2f}x" for phase, ratio in phases.items())
        out.append(f"CPU per operation, {LABELS[left]} / {LABELS[right]}: {figures or '-'}")
    lost = [
        f"{system} {phase}: {groups}"
        for system, entry in results["systems"].items()
        for phase, budget in (
            *(("throughput", run["cpu"]) for run in entry["throughput"]),
            ("latency", (entry.get("latency") or {}).get("cpu")),
        )
        if budget and (groups := budget["lost_processes"])
    ]
    if lost:
        out.append(
            "processes gone before their window ended (CPU undercounted): " + "; ".join(lost)
        )
    return out


def environment(args: argparse.Namespace, bench: Bench) -> dict[str, Any]:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "?"

    with psycopg.connect(args.database_url, autocommit=True) as connection:
        row = connection.execute("SHOW server_version").fetchone()
    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "postgres_server": str(row[0]) if row else "?",
        "packages": {name: version(name) for name in PACKAGES},
        "operations": args.operations,
        "runs": args.runs,
        "latency_rate_per_s": args.rate,
        "latency_seconds": args.seconds,
        "cpu_groups": {
            "writer": "the latency writer process, over its schedule (no writer in the "
            "throughput window: the backlog is inserted before it)",
            "dispatcher": "effect-outbox's dispatcher processes; the minimal relay",
            "consumers": "effect-outbox's consumer processes; the minimal consumer; "
            "the pgqueuer and procrastinate worker",
            "postgres": bench.postgres.describe(),
            "rabbitmq": bench.rabbitmq.describe()
            + " (effect-outbox and the minimal pipeline only: the peers do not use it)",
            "unseen": "a group none of whose processes this machine shows (a server "
            "elsewhere) is left out of cpu_seconds and listed in unseen_groups",
            "counted": "utime+stime of each root, its alive descendants and the children "
            "they reaped (cutime+cstime), from /proc/<pid>/stat",
            "clock_ticks_per_s": CLOCK_TICKS,
        },
        "outbox_settings": bench.outbox.as_dict(),
        "scale_out": (
            {
                "consumer_processes": args.scale_consumers,
                "dispatcher_processes": args.scale_dispatchers,
            }
            if args.scale_out
            else None
        ),
        "minimal": {"relay_batch": MINIMAL_BATCH, "consumer_prefetch": MINIMAL_PREFETCH},
        "pgqueuer": {"driver": "asyncpg", "batch_size": 10, "handler_pool": 10},
        "procrastinate": {"connector": "psycopg", "concurrency": bench.procrastinate_concurrency},
    }


# --- entry ---------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    role, url = args.child, args.child_url
    if role == "minimal-relay":
        run_loop(minimal_relay(url, args.amqp_url, args.child_names))
    elif role == "minimal-consumer":
        run_loop(minimal_consumer(url, args.amqp_url, args.child_names))
    elif role == "pgqueuer-worker":
        run_loop(pgqueuer_worker(url))
    elif role == "procrastinate-worker":
        run_loop(procrastinate_worker(url, args.procrastinate_concurrency))
    elif role.endswith("-writer"):
        written = run_loop(
            write_at_rate(role.removesuffix("-writer"), url, args.rate, args.seconds)
        )
        json.dump(written, sys.stdout)
    else:
        raise SystemExit(f"unknown child role {role!r}")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL),
        help="a database on the server to use (env OUTBOX_BENCH_DATABASE_URL); "
        "the benchmark creates and drops databases of its own next to it",
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("OUTBOX_BENCH_AMQP_URL", DEFAULT_AMQP_URL),
        help="RabbitMQ (env OUTBOX_BENCH_AMQP_URL)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help=f"where to write results (default {DEFAULT_JSON.relative_to(REPOSITORY)}, "
        f"with --scale-out {DEFAULT_SCALE_OUT_JSON.relative_to(REPOSITORY)})",
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument(
        "--operations", type=positive_int, default=5_000, help="throughput: per run"
    )
    parser.add_argument("--runs", type=positive_int, default=3, help="throughput runs per system")
    parser.add_argument("--rate", type=float, default=500.0, help="latency: decisions/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="latency: seconds per system")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument(
        "--outbox-consumers", type=positive_int, default=1, help="effect-outbox consumer processes"
    )
    parser.add_argument(
        "--outbox-dispatchers",
        type=positive_int,
        default=1,
        help="effect-outbox dispatcher processes (they share the outbox table, SKIP LOCKED)",
    )
    parser.add_argument("--outbox-prefetch", type=int, default=64)
    parser.add_argument("--outbox-batch-size", type=int, default=200)
    parser.add_argument("--outbox-lanes", type=int, default=2)
    parser.add_argument("--outbox-log-level", default="INFO")
    parser.add_argument(
        "--outbox-without-change-notify",
        action="store_true",
        help="disable the NOTIFY that wakes await_outcome's watchers (to measure its cost)",
    )
    parser.add_argument(
        "--scale-out",
        action="store_true",
        help="instead of the comparison: effect-outbox's drain only (--operations, --runs "
        "times), for each count of consumer processes x dispatcher processes",
    )
    parser.add_argument(
        "--scale-consumers",
        type=positive_int,
        nargs="+",
        default=[1, 2, 4],
        metavar="N",
        help="--scale-out: consumer process counts (default 1 2 4)",
    )
    parser.add_argument(
        "--scale-dispatchers",
        type=positive_int,
        nargs="+",
        default=[1, 2],
        metavar="N",
        help="--scale-out: dispatcher process counts (default 1 2)",
    )
    parser.add_argument("--procrastinate-concurrency", type=int, default=1)
    parser.add_argument("--py-spy", type=Path, default=None, metavar="DIR")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-url", help=argparse.SUPPRESS)
    parser.add_argument("--child-names", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json is None:
        args.json = DEFAULT_SCALE_OUT_JSON if args.scale_out else DEFAULT_JSON
    return args


def main() -> None:
    args = parse_arguments()
    if args.child:
        child(args)
        return
    args.database_url = libpq_url(args.database_url)
    outbox = OutboxSettings(
        consumers=args.outbox_consumers,
        dispatchers=args.outbox_dispatchers,
        prefetch=args.outbox_prefetch,
        batch_size=args.outbox_batch_size,
        lanes=args.outbox_lanes,
        log_level=args.outbox_log_level,
        change_notify=not args.outbox_without_change_notify,
    )
    systems = ["outbox"] if args.scale_out else args.systems
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="outbox-e2e-") as logs:
        bench = Bench(
            admin_url=args.database_url,
            amqp_url=args.amqp_url,
            run_name=uuid4().hex[:8],
            outbox=outbox,
            procrastinate_concurrency=args.procrastinate_concurrency,
            logs=Path(logs),
            postgres=postgres_selector(args.database_url),
            rabbitmq=rabbitmq_selector(args.amqp_url),
        )
        results: dict[str, Any] = {"environment": environment(args, bench)}
        try:
            if args.scale_out:
                results["scale_out"] = scale_out(bench, args)
            else:
                results["systems"] = compare(bench, args)
        finally:
            cleanup(bench, systems)
    failures = bench.failures
    if args.scale_out:
        report = scale_out_table(results["scale_out"])
    else:
        summarize(results)
        report = table(results)
    results["failures"] = failures
    results["total_seconds"] = time.monotonic() - began
    print("\n" + report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(json_safe(results), indent=2, allow_nan=False) + "\n")
    print(f"\nwritten to {args.json} ({results['total_seconds']:.0f} s in all)")
    for failure in failures:
        print(f"FAILED: {failure}")
    sys.exit(1 if failures else 0)


def throughput_runs(
    bench: Bench, system: str, args: argparse.Namespace, py_spy: Path | None
) -> list[dict[str, Any]]:
    """``--runs`` drains of ``--operations``; py-spy (if asked) on the first only."""
    measured_runs: list[dict[str, Any]] = []
    for run in range(args.runs):
        print(f"{system}: throughput run {run + 1}/{args.runs}", flush=True)
        spy = py_spy if run == 0 else None
        measured = run_phase(
            f"{system} throughput",
            bench.failures,
            lambda spy=spy: throughput(bench, system, args.operations, spy),  # type: ignore[misc]
        )
        if measured is not None:
            measured_runs.append(measured)
            bench.failures.extend(measured["failures"])
            budget = measured["cpu"]["cpu_ms_per_op"]
            print(
                f"  {measured['per_s']:,.0f} ops/s, {ms(budget[TOTAL])} CPU ms/op",
                flush=True,
            )
    return measured_runs


def compare(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """The four systems, one after another: throughput runs, then latency."""
    systems: dict[str, Any] = {}
    for system in args.systems:
        entry: dict[str, Any] = {"throughput": []}
        systems[system] = entry
        spy = args.py_spy if system == "outbox" else None
        entry["throughput"] = throughput_runs(bench, system, args, spy)
        if not args.skip_latency:
            print(f"{system}: latency, {args.rate:g}/s for {args.seconds:g} s", flush=True)
            measured = run_phase(
                f"{system} latency",
                bench.failures,
                lambda system=system: latency(bench, system, args.rate, args.seconds),  # type: ignore[misc]
            )
            if measured is not None:
                entry["latency"] = measured
                bench.failures.extend(measured["failures"])
                figures = measured["decision_to_effect_ms"]
                print(
                    f"  p50 {figures['p50']} ms, p99 {figures['p99']} ms, "
                    f"{ms(measured['cpu']['cpu_ms_per_op'][TOTAL])} CPU ms/op",
                    flush=True,
                )
    return systems


def scale_out(bench: Bench, args: argparse.Namespace) -> list[dict[str, Any]]:
    """effect-outbox's drain for each (consumer processes, dispatcher processes)."""
    points: list[dict[str, Any]] = []
    for consumers in args.scale_consumers:
        for dispatchers in args.scale_dispatchers:
            bench.outbox.consumers, bench.outbox.dispatchers = consumers, dispatchers
            print(f"{consumers} consumer(s), {dispatchers} dispatcher(s)", flush=True)
            point: dict[str, Any] = {"consumers": consumers, "dispatchers": dispatchers}
            point["throughput"] = throughput_runs(bench, "outbox", args, None)
            summarize_throughput(point)
            points.append(point)
    return points


def scale_out_table(points: Sequence[dict[str, Any]]) -> str:
    groups = [group for group in CPU_GROUPS if group != "writer"]
    header = (
        "consumers",
        "dispatchers",
        "operations/s, median (runs)",
        "CPU ms/op",
        *groups,
        "cores busy",
    )
    lines: list[tuple[str, ...]] = [header]
    for point in points:
        runs = ", ".join(f"{run['per_s']:,.0f}" for run in point["throughput"])
        rate = f"{point['per_s_median']:,.0f} ({runs})" if point["throughput"] else "-"
        median = point["cpu_median_run"]
        budget = point["throughput"][median]["cpu"] if median is not None else None
        per_op = budget["cpu_ms_per_op"] if budget else {}
        lines.append(
            (
                str(point["consumers"]),
                str(point["dispatchers"]),
                rate,
                ms(per_op.get(TOTAL)),
                *(ms(per_op.get(group)) for group in groups),
                f"{budget['cores_busy']:.2f}" if budget else "-",
            )
        )
    return "\n".join(
        [
            "effect-outbox drain, scaled out (CPU: /proc utime+stime, the median run by total)",
            *columns(lines, left={2}),
        ]
    )


def cleanup(bench: Bench, systems: Sequence[str]) -> None:
    """Drop what this run created, whatever happened."""
    for system in systems:
        with contextlib.suppress(Exception):
            bench.database(system).drop()
        if system in BROKER_SYSTEMS:
            with contextlib.suppress(Exception):
                run_loop(delete_topology(bench.amqp_url, topology_for(bench.names(system))))


if __name__ == "__main__":
    main()
