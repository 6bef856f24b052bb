from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
import services
import sqlalchemy as sa
from sample_tools import Ledger, build_registry
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from outbox import Registry, store
from outbox.settings import libpq_url, sqlalchemy_url, with_database


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
