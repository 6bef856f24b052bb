"""What `outbox demo` and the example agent create for one run, and proof it is gone."""

from __future__ import annotations

import asyncio
import re

import aio_pika
import aiormq.exceptions
import psycopg

# Both print this line once they have made their database and broker names.
CREATED = re.compile(r"database outbox_demo_(\w+) and broker names demo\.(\w+)\.\* created")


def tag_of(output: str) -> str:
    found = CREATED.search(output)
    assert found, f"the run never said what it created:\n{output}"
    assert found.group(1) == found.group(2)
    return found.group(1)


def assert_removed(tag: str, postgres_server_url: str, amqp_server_url: str) -> None:
    """What this run created is gone; other runs' objects are not ours."""
    with psycopg.connect(postgres_server_url, autocommit=True) as connection:
        left = connection.execute(
            "SELECT datname FROM pg_database WHERE datname = %s", (f"outbox_demo_{tag}",)
        ).fetchall()
    assert left == []
    assert asyncio.run(existing_queues(amqp_server_url, tag)) == []


async def existing_queues(amqp_url: str, tag: str) -> list[str]:
    existing = []
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        for queue in (f"demo.{tag}.operations", f"demo.{tag}.operations.dead"):
            # A passive declare of a missing queue closes its channel: one channel each.
            try:
                await (await connection.channel()).get_queue(queue, ensure=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                continue
            existing.append(queue)
    return existing
