"""``outbox console`` over HTTP, against the real database, as a login that is only an
operator: authentication, CSRF, escaping, and the guarded actions. Each refusal is
checked to have changed nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from outbox import Registry, Settings
from outbox.console.app import Console

from support.console_helpers import client, console, console_settings, operator_login
from support.ops_helpers import Ops


@pytest.fixture
def operator_url(postgres_server_url: str, database_url: str) -> Iterator[str]:
    with operator_login(postgres_server_url, database_url) as url:
        yield url


@pytest.fixture
def app_console(settings: Settings, operator_url: str, registry: Registry) -> Console:
    return console(console_settings(settings, operator_url), registry=registry)


@pytest.fixture
def browser(app_console: Console) -> Iterator[TestClient]:
    with client(app_console) as test_client:
        yield test_client


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)
