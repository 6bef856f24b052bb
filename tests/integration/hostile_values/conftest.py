"""Every value a role can write is hostile: the attacks of the hostile-values issue, each
made as a LOGIN user that holds one group role only (or, for what no role can do any
more, as the tables' owner writing around the bounds, as a row from before them would
be), and what the database, the daemons and every operator view do with it.

A role controls only the values its grant names, and every reader survives any value a
role can write (docs/design.md section 7)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox import Registry

from support.logins import Login, group_logins
from support.ops_helpers import Ops


@pytest.fixture
def login(postgres_server_url: str, database_url: str) -> Iterator[Login]:
    with group_logins(postgres_server_url, database_url) as make:
        yield make


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)
