"""`outbox mcp` through the real MCP client: in memory, and over streamable HTTP."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from outbox import Registry, Settings

from support.mcp_cases import build_registry
from support.ops_helpers import Ops


@pytest.fixture
def registry() -> Registry:
    return build_registry()


@pytest.fixture
def settings(database_url: str) -> Settings:
    # Generous transaction bounds: the machine running the tests may be busy (and the
    # lease margin, which no call here uses, longer still, as settings require).
    return Settings(
        database_url=SecretStr(database_url), db_transaction_timeout=30.0, lease_margin=31.0
    )


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)
