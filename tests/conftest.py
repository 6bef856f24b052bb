from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from harness.proxy import TcpProxy, tcp_proxy_for
from outbox import Registry, Settings
from outbox.broker import Topology, delete_topology
from outbox.sandbox.scratch import ScratchDatabase, new_tag, topology_named
from outbox.settings import libpq_url, sqlalchemy_url

from support import private_postgres, prometheus, rabbit_cluster, services
from support.sample_tools import Ledger, build_registry


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    try:
        with services.postgres_url() as url:
            yield libpq_url(url)
    except services.ServicesUnavailable as missing:
        pytest.fail(str(missing), pytrace=False)


@pytest.fixture(scope="session")
def template_database(postgres_server_url: str) -> Iterator[str]:
    """A database with schema.sql applied once; every test copies it."""
    with ScratchDatabase.unique(postgres_server_url, "outbox_test_template") as template:
        yield template.name


@pytest.fixture
def database_url(postgres_server_url: str, template_database: str) -> Iterator[str]:
    """A fresh database, copied from the template, dropped after the test."""
    with ScratchDatabase.unique(
        postgres_server_url, "outbox_test", template=template_database
    ) as database:
        yield database.url


@pytest.fixture
def empty_database_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh database without the outbox schema."""
    with ScratchDatabase.unique(
        postgres_server_url, "outbox_test_empty", apply_schema=False
    ) as database:
        yield database.url


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
async def broker_names(amqp_server_url: str) -> AsyncIterator[Topology]:
    """Exchange and queue names of this test's own, deleted afterwards (LIFO). Not
    declared: the daemons declare them, or a test shows what happens when none did."""
    names = topology_named(f"test.{new_tag()}")
    yield names
    await delete_topology(amqp_server_url, names)


@pytest.fixture
def settings(database_url: str, amqp_server_url: str, broker_names: Topology) -> Settings:
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


@pytest.fixture
async def database_proxy(postgres_server_url: str) -> AsyncIterator[TcpProxy]:
    """A TCP proxy in front of the Postgres server, to slow or silence one daemon's link."""
    async with tcp_proxy_for(postgres_server_url, 5432) as proxy:
        yield proxy


@pytest.fixture
async def broker_proxy(amqp_server_url: str) -> AsyncIterator[TcpProxy]:
    """A TCP proxy in front of the broker, to slow, silence or cut one daemon's link."""
    async with tcp_proxy_for(amqp_server_url, 5672) as proxy:
        yield proxy


REQUIRE_RABBITMQCTL = "OUTBOX_TEST_REQUIRE_RABBITMQCTL"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Broker-fault tests, the chaos run and the cluster test start RabbitMQ nodes of
    their own with rabbitmq-server; the console's browser tests drive Debian's
    chromium through chromedriver; the alert and dashboard tests run Debian's promtool
    and prometheus; the failover tests run private Postgres servers with the installed
    initdb and pg_basebackup. Where those are absent the tests are skipped,
    unless the run demands them (.ci/run sets OUTBOX_TEST_REQUIRE_RABBITMQCTL): then
    they run and fail, rather than pass by not running."""
    if os.environ.get(REQUIRE_RABBITMQCTL):
        return
    missing = {
        "rabbit_cluster": None if rabbit_cluster.installed() else "rabbitmq-server",
        "browser": None
        if all(os.access(p, os.X_OK) for p in ("/usr/bin/chromium", "/usr/bin/chromedriver"))
        else "chromium or chromium-driver (apt-get install chromium chromium-driver)",
        "prometheus": None if prometheus.installed() else f"prometheus ({prometheus.INSTALL_HINT})",
        "pg_failover": None if private_postgres.installed() else "Postgres (initdb, pg_ctl)",
    }
    for item in items:
        for marker, absent in missing.items():
            if absent and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"{absent} is not installed here"))
