"""The systems bench/e2e.py compares, each one class on the ``System`` protocol.

A system sets up its own database (and broker names), writes decisions as its users
would (a backlog in one transaction for the drain, one per transaction for the latency
writer), names the daemons that drain it with the CPU group of each, reads back when
each effect happened, checks what it must, and tears down. The driver (bench/e2e.py)
knows nothing else about any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID, uuid4

import aio_pika
import psycopg

from bench.e2e_tools import TOOL, build_registry
from bench.reporting import percentile
from outbox import RecordedDecision, Settings, record_decision, record_decision_async
from outbox.broker import Topology, declare_topology, delete_topology
from outbox.cli import run_async
from outbox.sandbox.processes import python_module
from outbox.sandbox.scratch import ScratchDatabase

READY = "e2e.ready"
# The module the children run as: `python -m bench.e2e --child <system>-<role>`.
CHILD_MODULE = "bench.e2e"
INSERT_CHUNK = 500
MINIMAL_BATCH = 200
MINIMAL_PREFETCH = 500

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


# --- systems whose effects land in an inbox table ---------------------------------------

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


# --- the minimal pipeline ------------------------------------------------------------

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


@dataclass
class Minimal(InboxSystem):
    """A hand-written pipeline with no guarantees, the physical limit: a relay claims
    rows (SKIP LOCKED, LISTEN/NOTIFY), publishes them with every confirm outstanding,
    marks them; a consumer inserts each burst of deliveries into the inbox in one
    statement and acks the burst with one multiple-ack."""

    name: str = "minimal"
    label: str = "minimal pipeline (no guarantees)"
    uses_broker: bool = True

    def topology(self) -> Topology:
        return topology_for(self.context.names(self.name))

    def set_up(self) -> str:
        url = super().set_up()
        with contextlib.suppress(Exception):
            run_async(delete_topology(self.context.amqp_url, self.topology()))
        return url

    def install(self, url: str) -> None:
        with psycopg.connect(url) as connection:
            connection.execute(MINIMAL_DDL)

    def tear_down(self) -> None:
        super().tear_down()
        with contextlib.suppress(Exception):
            run_async(delete_topology(self.context.amqp_url, self.topology()))

    @contextlib.contextmanager
    def backlog(self, url: str, count: int) -> Iterator[bool]:
        with psycopg.connect(url, autocommit=True) as connection, connection.transaction():
            connection.execute(
                "INSERT INTO mini_outbox (key) "
                "SELECT gen_random_uuid() FROM generate_series(1, %s)",
                (count,),
            )
            yield True

    async def writer(self, url: str) -> tuple[Enqueue, Close]:
        # Every writer commits each decision as one statement in autocommit.
        connection = await psycopg.AsyncConnection.connect(url, autocommit=True)

        async def enqueue(n: int) -> str:
            key = uuid4()
            await connection.execute("INSERT INTO mini_outbox (key) VALUES (%s)", (key,))
            return str(key)

        return enqueue, connection.close

    def daemons(self, url: str) -> list[list[Daemon]]:
        env = dict(os.environ)
        return [
            [
                Daemon(
                    "consumers",
                    "consumer",
                    self.context.child(self.name, "consumer", url),
                    READY,
                    env,
                )
            ],
            [
                Daemon(
                    "dispatcher", "relay", self.context.child(self.name, "relay", url), READY, env
                )
            ],
        ]

    def child(self, role: str, url: str) -> Coroutine[Any, Any, None]:
        if role == "relay":
            return self.relay(url)
        if role == "consumer":
            return self.consumer(url)
        raise SystemExit(f"the minimal pipeline has no child {role!r}")

    async def relay(self, url: str) -> None:
        """Claim, publish with every confirm outstanding, mark, commit; woken by NOTIFY."""
        topology = self.topology()
        listener = await psycopg.AsyncConnection.connect(url, autocommit=True)
        await listener.execute("LISTEN mini_pending")
        database = await psycopg.AsyncConnection.connect(url)
        connection = await aio_pika.connect(self.context.amqp_url, timeout=10)
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await declare_topology(channel, topology)
        raw = await channel.get_underlay_channel()
        wake = asyncio.Event()

        async def forward() -> None:
            async for _ in listener.notifies():
                wake.set()

        forwarding = asyncio.create_task(forward())
        properties = aio_pika.Message(
            b"", delivery_mode=aio_pika.DeliveryMode.PERSISTENT
        ).properties
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

    async def consumer(self, url: str) -> None:
        """Deliveries into the inbox in bursts: one INSERT and one multiple-ack per burst.

        Flushes run one at a time and each takes everything delivered so far, so every
        delivery tag up to the burst's last one is in this burst or an earlier, committed
        one: the multiple-ack never acks an uncommitted delivery.
        """
        database = await psycopg.AsyncConnection.connect(url)
        connection = await aio_pika.connect(self.context.amqp_url, timeout=10)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=MINIMAL_PREFETCH)
        declared = await declare_topology(channel, self.topology())
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


# --- pgqueuer ------------------------------------------------------------------------


@dataclass
class Pgqueuer(InboxSystem):
    """One worker (asyncpg, library defaults: batch 10) whose no-op handler records
    completion in the inbox."""

    name: str = "pgqueuer"
    label: str = "pgqueuer"

    def install(self, url: str) -> None:
        run_async(self.install_async(url))

    async def install_async(self, url: str) -> None:
        import asyncpg  # type: ignore[import-untyped]
        from pgqueuer import Queries

        connection = await asyncpg.connect(url)
        try:
            await Queries.from_asyncpg_connection(connection).install()
        finally:
            await connection.close()

    @contextlib.contextmanager
    def backlog(self, url: str, count: int) -> Iterator[bool]:
        from pgqueuer.adapters.drivers.psycopg import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        # Autocommit, with an explicit transaction: what pgqueuer's synchronous driver needs.
        with psycopg.connect(url, autocommit=True) as connection, connection.transaction():
            queries = SyncQueries(SyncPsycopgDriver(connection))
            for begin in range(0, count, INSERT_CHUNK):
                size = min(INSERT_CHUNK, count - begin)
                queries.enqueue(["noop"] * size, [uuid4().bytes for _ in range(size)], [0] * size)
            yield True

    async def writer(self, url: str) -> tuple[Enqueue, Close]:
        import asyncpg
        from pgqueuer import Queries

        pg = await asyncpg.connect(url)
        queries = Queries.from_asyncpg_connection(pg)

        async def enqueue(n: int) -> str:
            key = uuid4()
            # One statement, outside a transaction block: its own transaction.
            await queries.enqueue("noop", key.bytes)
            return str(key)

        return enqueue, pg.close

    def daemons(self, url: str) -> list[list[Daemon]]:
        worker = self.context.child(self.name, "worker", url)
        return [[Daemon("consumers", "worker", worker, READY, dict(os.environ))]]

    def child(self, role: str, url: str) -> Coroutine[Any, Any, None]:
        if role != "worker":
            raise SystemExit(f"pgqueuer has no child {role!r}")
        return self.worker(url)

    async def worker(self, url: str) -> None:
        import asyncpg
        from pgqueuer import PgQueuer
        from pgqueuer.models import Job

        connection = await asyncpg.connect(url)
        pool = await asyncpg.create_pool(url, min_size=2, max_size=10)
        pgq = PgQueuer.from_asyncpg_connection(connection)

        @pgq.entrypoint("noop")
        async def noop(job: Job) -> None:
            assert job.payload is not None
            await pool.execute(
                "INSERT INTO inbox (key) VALUES ($1) ON CONFLICT DO NOTHING",
                UUID(bytes=job.payload),
            )

        ready_marker()
        await pgq.run()


# --- procrastinate -------------------------------------------------------------------


@dataclass
class Procrastinate(InboxSystem):
    """One worker (psycopg pool, ``--procrastinate-concurrency``) whose no-op task
    records completion in the inbox. It defers on its own pool, each batch in a
    transaction of its own: its backlog is committed before its worker starts."""

    name: str = "procrastinate"
    label: str = "procrastinate"

    def app(self, url: str) -> Any:
        import procrastinate

        return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    def install(self, url: str) -> None:
        run_async(self.install_async(url))

    async def install_async(self, url: str) -> None:
        app = self.app(url)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    @contextlib.contextmanager
    def backlog(self, url: str, count: int) -> Iterator[bool]:
        run_async(self.defer_backlog(url, count))
        yield False

    async def defer_backlog(self, url: str, count: int) -> None:
        app = self.app(url)
        async with app.open_async():
            task = app.configure_task("noop")
            for start in range(0, count, INSERT_CHUNK):
                size = min(INSERT_CHUNK, count - start)
                await task.batch_defer_async(*({"key": str(uuid4())} for _ in range(size)))

    async def writer(self, url: str) -> tuple[Enqueue, Close]:
        app = self.app(url)
        await app.open_async()
        task = app.configure_task("noop")

        async def enqueue(n: int) -> str:
            # procrastinate defers on its own pooled connection, in a transaction of its own.
            key = uuid4()
            await task.defer_async(key=str(key))
            return str(key)

        close: Close = app.close_async
        return enqueue, close

    def daemons(self, url: str) -> list[list[Daemon]]:
        worker = self.context.child(self.name, "worker", url)
        return [[Daemon("consumers", "worker", worker, READY, dict(os.environ))]]

    def child(self, role: str, url: str) -> Coroutine[Any, Any, None]:
        if role != "worker":
            raise SystemExit(f"procrastinate has no child {role!r}")
        return self.worker(url)

    async def worker(self, url: str) -> None:
        app = self.app(url)

        @app.task(name="noop")  # type: ignore[untyped-decorator]
        async def noop(key: str) -> None:
            await app.connector.execute_query_async(
                "INSERT INTO inbox (key) VALUES (%(key)s::uuid) ON CONFLICT DO NOTHING", key=key
            )

        async with app.open_async():
            ready_marker()
            await app.run_worker_async(concurrency=self.context.procrastinate_concurrency)


# --- effect-outbox -------------------------------------------------------------------


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "chunk_operations": self.chunk_operations or Settings().message_operations,
            "change_notify": self.change_notify,
            "consumer_processes": self.consumers,
            "dispatcher_processes": self.dispatchers,
            "prefetch": self.prefetch or Settings().prefetch,
            "dispatcher_batch_size": self.batch_size,
            "dispatch_lanes": self.lanes,
            "log_level": self.log_level,
            "event_loop": "uvloop",
        }


COMMITTED_EFFECTS = (
    "SELECT operation_id::text, extract(epoch FROM created_at)::float8 "
    "FROM operation_events WHERE name = 'operation.committed'"
)
COMMITTED_COUNT = "SELECT count(*) FROM operation_events WHERE name = 'operation.committed'"
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
CHECK_SQL = """
SELECT count(*), count(*) FILTER (WHERE state = 'committed'),
       count(*) FILTER (WHERE attempts <> 1),
       (SELECT count(*) FROM (SELECT operation_id FROM operation_events
        WHERE name = 'operation.committed' GROUP BY operation_id HAVING count(*) > 1) d)
FROM operations
"""


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
        url = self.database().recreate()
        if not self.settings.change_notify:
            with psycopg.connect(url) as connection:
                connection.execute(
                    "ALTER TABLE operation_events DISABLE TRIGGER operation_events_notify_changed"
                )
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
        """p50 and p99 of each stage in ms (published_at is the mark's transaction start,
        so the broker hop shows in published_to_claimed)."""
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


SYSTEM_NAMES = (
    "minimal",
    "outbox",
    "outbox-single",
    "outbox-in-transaction",
    "pgqueuer",
    "procrastinate",
)


def systems(context: Context, outbox: OutboxSettings | None = None) -> dict[str, System]:
    """Every system, by name, in the order the comparison runs them."""
    found: dict[str, System] = {
        "minimal": Minimal(context),
        "outbox": Outbox(context, outbox or OutboxSettings()),
        "outbox-single": SingleOutbox(context, outbox or OutboxSettings()),
        "outbox-in-transaction": OutboxInTransaction(context, outbox or OutboxSettings()),
        "pgqueuer": Pgqueuer(context),
        "procrastinate": Procrastinate(context),
    }
    assert tuple(found) == SYSTEM_NAMES
    return found
