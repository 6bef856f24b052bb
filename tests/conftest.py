from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator

import aio_pika
import psycopg
import pytest
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from outbox import Registry, Settings, store
from outbox.settings import libpq_url, sqlalchemy_url, with_database

from support import services
from support.broker_helpers import BrokerNames
from support.sample_tools import Ledger, build_registry


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    try:
        with services.postgres_url() as url:
            yield libpq_url(url)
    except services.ServicesUnavailable as missing:
        pytest.fail(str(missing), pytrace=False)


def _admin(server_url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(server_url, autocommit=True)


@pytest.fixture(scope="session")
def template_database(postgres_server_url: str) -> Iterator[str]:
    """A database with schema.sql applied once; every test copies it."""
    name = f"outbox_test_template_{uuid.uuid4().hex[:8]}"
    with _admin(postgres_server_url) as admin:
        store.create_database(admin, name)
    try:
        with psycopg.connect(with_database(postgres_server_url, name)) as connection:
            store.apply_schema(connection)
        yield name
    finally:
        with _admin(postgres_server_url) as admin:
            store.drop_database(admin, name)


@contextlib.contextmanager
def fresh_database(server_url: str, prefix: str, template: str | None = None) -> Iterator[str]:
    """A new database (a copy of ``template`` if given), dropped on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with _admin(server_url) as admin:
        store.create_database(admin, name, template=template)
    try:
        yield with_database(server_url, name)
    finally:
        with _admin(server_url) as admin:
            store.drop_database(admin, name)


@pytest.fixture
def database_url(postgres_server_url: str, template_database: str) -> Iterator[str]:
    """A fresh database, copied from the template, dropped after the test."""
    with fresh_database(postgres_server_url, "outbox_test", template_database) as url:
        yield url


@pytest.fixture
def empty_database_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh database without the outbox schema."""
    with fresh_database(postgres_server_url, "outbox_test_empty") as url:
        yield url


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    yield engine
    engine.dispose()


@pytest.fixture
async def async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(sqlalchemy_url(database_url), poolclass=NullPool)
    yield engine
    await engine.dispose()


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
def registry(ledger: Ledger) -> Registry:
    return build_registry(ledger)


@pytest.fixture(scope="session")
def amqp_server_url() -> Iterator[str]:
    try:
        with services.amqp_url() as url:
            yield url
    except services.ServicesUnavailable as missing:
        pytest.fail(str(missing), pytrace=False)


@pytest.fixture
async def broker_names(amqp_server_url: str) -> AsyncIterator[BrokerNames]:
    """Exchange and queue names of this test's own, deleted afterwards (LIFO)."""
    names = BrokerNames.unique()
    yield names
    connection = await aio_pika.connect(amqp_server_url)
    async with connection:
        channel = await connection.channel()
        for queue in (names.queue, names.dead_letter_queue):
            await channel.queue_delete(queue)
        for exchange in (names.exchange, names.dead_letter_exchange):
            await channel.exchange_delete(exchange)


@pytest.fixture
def settings(database_url: str, amqp_server_url: str, broker_names: BrokerNames) -> Settings:
    """Settings for daemons under test: this test's database and broker names, short
    waits so that conditions are reached quickly, a free metrics port."""
    return Settings(
        database_url=SecretStr(database_url),
        amqp_url=SecretStr(amqp_server_url),
        exchange=broker_names.exchange,
        queue=broker_names.queue,
        dead_letter_exchange=broker_names.dead_letter_exchange,
        dead_letter_queue=broker_names.dead_letter_queue,
        poll_interval=0.2,
        publish_timeout=5.0,
        publish_retry_initial=0.05,
        publish_retry_max=0.2,
        metrics_host="127.0.0.1",
        metrics_port=0,
        # Tests shrink the lease margin so leases expire quickly; the database bounds,
        # derived from it by default, stay at a size a busy machine always meets.
        db_transaction_timeout=5.0,
        # Each test's broker names are new: its daemons declare them, where a deployment
        # runs `outbox migrate --broker` (tests of that path turn this off).
        declare_topology=True,
    )


REQUIRE_RABBITMQCTL = "OUTBOX_TEST_REQUIRE_RABBITMQCTL"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Broker-fault tests drive the local broker with rabbitmqctl. Where it is absent they
    are skipped, unless the run demands them (.ci/run sets OUTBOX_TEST_REQUIRE_RABBITMQCTL)."""
    if shutil.which("rabbitmqctl") or os.environ.get(REQUIRE_RABBITMQCTL):
        return
    absent = pytest.mark.skip(reason="rabbitmqctl is not installed on this machine")
    for item in items:
        if "rabbitmqctl" in item.keywords:
            item.add_marker(absent)
