"""Running the dispatcher inside a test and writing decisions in bulk."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import psycopg

from consumer.worker import Consumer
from dispatcher.daemon import Dispatcher
from outbox import Registry, Settings, record_decision

from support.waiting import eventually


def record_many(
    database_url: str, registry: Registry, count: int, *, run_id: str = "run", chunk: int = 500
) -> list[int]:
    """Record ``count`` decisions (committed in chunks); returns their outbox ids."""
    with psycopg.connect(database_url) as connection:
        for start in range(0, count, chunk):
            with connection.transaction():
                for n in range(start, min(count, start + chunk)):
                    record_decision(
                        connection,
                        registry,
                        "send_refund",
                        {"payment_id": f"pay_{n}", "amount_cents": 100 + n},
                        run_id=run_id,
                        decision_key=f"call_{n}",
                    )
        return outbox_ids(connection)


def record_one(
    database_url: str, registry: Registry, *, payment_id: str = "pay_1", amount_cents: int = 1250
) -> UUID:
    """Record one refund decision, committed; returns its operation id."""
    with psycopg.connect(database_url) as connection:
        recorded = record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": payment_id, "amount_cents": amount_cents},
            run_id="run",
        )
        connection.commit()
    return recorded.operation.id


def outbox_ids(connection: psycopg.Connection[Any]) -> list[int]:
    return [row[0] for row in connection.execute("SELECT id FROM outbox ORDER BY id")]


def publish_state(database_url: str) -> tuple[int, int]:
    """(rows, rows published), as committed."""
    with psycopg.connect(database_url, autocommit=True) as connection:
        row = connection.execute("SELECT count(*), count(published_at) FROM outbox").fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


async def all_published(database_url: str, expected: int) -> bool:
    return await asyncio.to_thread(publish_state, database_url) == (expected, expected)


@contextlib.asynccontextmanager
async def running_dispatcher(settings: Settings) -> AsyncIterator[Dispatcher]:
    """A dispatcher daemon on this event loop, ready (listening) when the block starts."""
    dispatcher = Dispatcher(settings)
    task = asyncio.create_task(dispatcher.run())
    try:
        await eventually(
            _ready(dispatcher, task), within=20, what="the dispatcher session to be ready"
        )
        yield dispatcher
    finally:
        dispatcher.stop()
        await asyncio.wait_for(task, timeout=20)


def _ready(dispatcher: Dispatcher, task: asyncio.Task[None]) -> Any:
    async def check() -> bool:
        if task.done():
            task.result()  # surface why the daemon died
            raise AssertionError("the dispatcher stopped before it was ready")
        return dispatcher.healthy()

    return check


def counter_value(daemon: Dispatcher | Consumer, name: str, **labels: str) -> float:
    """The current value of one sample of a daemon's metrics (0 when never touched)."""
    for family in daemon.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
