"""Misconfigurations that used to look healthy: each daemon refuses to run instead."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiormq.exceptions
import psycopg
import pytest
from prometheus_client import CollectorRegistry
from psycopg import sql
from pydantic import SecretStr

from consumer.worker import Consumer
from dispatcher.daemon import Dispatcher
from outbox import Registry, Settings
from outbox import schema as outbox_schema
from outbox.errors import ConfigurationError, SchemaMissing
from outbox.migrate import declare_broker_topology
from outbox.observability import serve_http

from support.broker_helpers import read_all
from support.dispatch_helpers import record_many
from support.logs import logged, records_of
from support.ports import closed_port, taken_port
from support.waiting import eventually

# Long enough for a daemon to refuse; a daemon that does not refuse runs into it.
REFUSES_WITHIN = 20


def without_topology(settings: Settings, **changes: Any) -> Settings:
    """As deployed: the daemon may only use the topology `outbox migrate --broker` made."""
    return settings.model_copy(update={"declare_topology": False, **changes})


async def queue_exists(amqp_url: str, name: str) -> bool:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        try:
            await (await connection.channel()).get_queue(name, ensure=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
    return True


# --- 1. no schema ----------------------------------------------------------------------


def unreachable(**fields: Any) -> Settings:
    """Settings whose services nothing answers for, except what ``fields`` sets."""
    defaults: dict[str, Any] = {
        "database_url": SecretStr(f"postgresql://postgres@127.0.0.1:{closed_port()}/outbox"),
        "amqp_url": SecretStr(f"amqp://guest:guest@127.0.0.1:{closed_port()}/"),
        "metrics_host": "127.0.0.1",
        "metrics_port": 0,
    }
    return Settings(**{**defaults, **fields})


async def test_a_consumer_on_a_database_without_the_schema_refuses_to_start(
    empty_database_url: str, registry: Registry
) -> None:
    # No broker at all: the schema is checked first, so nothing is consumed meanwhile.
    consumer = Consumer(unreachable(database_url=SecretStr(empty_database_url)), registry)

    with pytest.raises(SchemaMissing, match="outbox migrate"):
        await asyncio.wait_for(consumer.run(), timeout=REFUSES_WITHIN)
    assert not consumer.healthy()


async def test_a_consumer_waits_for_a_database_that_does_not_answer(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = Consumer(unreachable(), registry)
    task = asyncio.create_task(consumer.run())
    try:

        async def retrying() -> bool:
            assert not task.done(), "the consumer gave up on a database that may come back"
            return logged(caplog, "consumer.connect_retry", peer="database", attempt=2)

        await eventually(retrying, within=REFUSES_WITHIN, what="the consumer to retry")
        assert not consumer.healthy()
    finally:
        consumer.stop()
        await asyncio.wait_for(task, timeout=REFUSES_WITHIN)
    assert not records_of(caplog, "consumer.session_ready")  # it never went on to consume


@pytest.mark.parametrize("daemon", ["dispatcher", "consumer"])
async def test_a_daemon_on_a_database_that_does_not_exist_names_it_and_says_what_to_do(
    postgres_server_url: str,
    registry: Registry,
    caplog: pytest.LogCaptureFixture,
    daemon: str,
) -> None:
    missing = f"outbox_missing_{uuid.uuid4().hex[:12]}"
    url = urlunsplit(urlsplit(postgres_server_url)._replace(path=f"/{missing}"))
    settings = unreachable(database_url=SecretStr(url))
    running: Dispatcher | Consumer = (
        Dispatcher(settings) if daemon == "dispatcher" else Consumer(settings, registry)
    )
    task = asyncio.create_task(running.run())
    try:

        async def told() -> bool:
            assert not task.done(), f"the {daemon} gave up on a database that may be created"
            return logged(
                caplog,
                f"{daemon}.connect_retry",
                peer="database",
                database=missing,
                cause="the database does not exist",
            )

        await eventually(told, within=REFUSES_WITHIN, what=f"the {daemon} to name the database")
    finally:
        running.stop()
        await asyncio.wait_for(task, timeout=REFUSES_WITHIN)
    (line,) = {getattr(r, "do", None) for r in records_of(caplog, f"{daemon}.connect_retry")}
    assert line is not None
    assert "outbox migrate" in line


async def test_a_least_privilege_consumer_passes_the_schema_check(
    postgres_server_url: str,
    database_url: str,
    registry: Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The consumer's role may not read the schema version table: the check must not
    # take that refusal for a missing schema, or a least-privilege consumer never starts.
    with psycopg.connect(database_url) as connection:
        outbox_schema.apply_roles(connection)
    user = f"outbox_test_consumer_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN IN ROLE outbox_consumer").format(sql.Identifier(user))
        )
    parts = urlsplit(database_url)
    as_consumer = urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port}"))
    consumer = Consumer(unreachable(database_url=SecretStr(as_consumer)), registry)
    task = asyncio.create_task(consumer.run())
    try:

        async def on_to_the_broker() -> bool:
            if task.done():
                task.result()
            return bool(records_of(caplog, "consumer.session_lost"))

        await eventually(on_to_the_broker, within=REFUSES_WITHIN, what="the broker stage")
    finally:
        consumer.stop()
        await asyncio.wait_for(task, timeout=REFUSES_WITHIN)
        with psycopg.connect(postgres_server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("REVOKE outbox_consumer FROM {}").format(sql.Identifier(user)))
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))


# --- 2. the broker topology is the operator's, not the daemon's ------------------------


async def test_a_dispatcher_refuses_to_publish_without_the_topology_and_declares_nothing(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 1)
    dispatcher = Dispatcher(without_topology(settings))

    with pytest.raises(ConfigurationError) as refused:
        await asyncio.wait_for(dispatcher.drain(), timeout=REFUSES_WITHIN)

    message = str(refused.value)
    assert "outbox migrate --broker" in message
    assert "OUTBOX_EXCHANGE" in message
    assert "OUTBOX_DECLARE_TOPOLOGY" in message
    assert "\n" not in message
    assert not await queue_exists(amqp_server_url, settings.queue)


async def test_a_dispatcher_with_a_mistyped_queue_name_refuses_to_run(
    settings: Settings, amqp_server_url: str
) -> None:
    await declare_broker_topology(settings)  # what `outbox migrate --broker` does
    mistyped = f"{settings.queue}.typo"
    dispatcher = Dispatcher(without_topology(settings, queue=mistyped))

    with pytest.raises(ConfigurationError, match=r"queue '[^']+\.typo' \(OUTBOX_QUEUE\)"):
        await asyncio.wait_for(dispatcher.run(), timeout=REFUSES_WITHIN)
    assert not await queue_exists(amqp_server_url, mistyped)


async def test_a_consumer_refuses_to_consume_without_the_topology(
    settings: Settings, registry: Registry, amqp_server_url: str
) -> None:
    consumer = Consumer(without_topology(settings), registry)

    with pytest.raises(ConfigurationError, match="outbox migrate --broker"):
        await asyncio.wait_for(consumer.run(), timeout=REFUSES_WITHIN)
    assert not consumer.healthy()
    assert not await queue_exists(amqp_server_url, settings.queue)


async def test_the_topology_migrate_declared_is_used_as_it_is(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    await declare_broker_topology(settings)
    ids = await asyncio.to_thread(record_many, database_url, registry, 3)

    report = await Dispatcher(without_topology(settings)).drain()

    assert (report.published, report.failed) == (3, 0)
    messages = await read_all(amqp_server_url, settings.queue, expect=3)
    assert sorted(m.body.outbox_id for m in messages) == ids


async def test_declare_topology_lets_the_daemon_create_it(
    settings: Settings, registry: Registry, database_url: str, amqp_server_url: str
) -> None:
    await asyncio.to_thread(record_many, database_url, registry, 1)

    report = await Dispatcher(settings.model_copy(update={"declare_topology": True})).drain()

    assert (report.published, report.failed) == (1, 0)
    assert await queue_exists(amqp_server_url, settings.queue)


# --- 4. a metrics port already taken ---------------------------------------------------


async def test_an_address_the_host_does_not_have_is_one_line_too() -> None:
    with pytest.raises(ConfigurationError) as refused:
        async with serve_http("192.0.2.1", 0, CollectorRegistry(), lambda: True):
            pass

    message = str(refused.value)
    assert "192.0.2.1:0" in message
    assert "--metrics-host" in message
    assert "\n" not in message


async def test_a_consumer_whose_metrics_port_is_taken_says_so_in_one_line(
    registry: Registry,
) -> None:
    with taken_port() as port:
        consumer = Consumer(unreachable(metrics_port=port), registry)
        with pytest.raises(ConfigurationError) as refused:
            await asyncio.wait_for(consumer.run(), timeout=REFUSES_WITHIN)

    message = str(refused.value)
    assert f"127.0.0.1:{port}" in message
    assert "--metrics-port 0" in message
    assert "\n" not in message


async def test_a_dispatcher_whose_metrics_port_is_taken_says_so_in_one_line() -> None:
    with taken_port() as port:
        dispatcher = Dispatcher(unreachable(metrics_port=port))
        with pytest.raises(ConfigurationError, match="--metrics-port 0"):
            await asyncio.wait_for(dispatcher.run(), timeout=REFUSES_WITHIN)


# --- secrets in a database URL ---------------------------------------------------------


@pytest.mark.parametrize(
    ("parameter", "libpq_reads_it"),
    [("sslpassword", True), ("pass%77ord", True), ("PASSWORD", False), ("ssl%2570assword", False)],
)
def test_outbox_migrate_never_prints_a_secret_parameter_of_the_url(
    database_url: str, postgres_server_url: str, parameter: str, libpq_reads_it: bool
) -> None:
    canary = f"Canary{uuid.uuid4().hex}"
    outbox = str(Path(sys.executable).parent / "outbox")

    def migrate_at(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [outbox, "migrate", "--database-url", f"{url}?{parameter}={canary}"],
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ.copy(),
            check=False,
        )

    applied = migrate_at(database_url)
    closed = urlunsplit(urlsplit(postgres_server_url)._replace(netloc=f"127.0.0.1:{closed_port()}"))
    refused = migrate_at(closed)

    assert canary not in applied.stdout + applied.stderr
    assert canary not in refused.stdout + refused.stderr
    assert refused.returncode != 0
    if libpq_reads_it:
        # Applied, and then refused for the closed port: each names where, not the secret.
        assert applied.returncode == 0, applied.stderr
        assert f"{parameter}=***" in applied.stdout
        assert f"{parameter}=***" in refused.stderr
    else:
        # A name libpq does not take: refused before anything is shown of the URL.
        assert applied.returncode != 0
        assert "libpq cannot read this URL" in refused.stderr
