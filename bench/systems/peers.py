"""The peers: pgqueuer and procrastinate, each draining its own job table into the
inbox."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4

import psycopg

from bench.systems.base import (
    INSERT_CHUNK,
    READY,
    Close,
    Daemon,
    Enqueue,
    InboxSystem,
    ready_marker,
)
from outbox.cli import run_async


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
