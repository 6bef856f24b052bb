"""LOGIN users that hold one of the group roles roles.sql creates, for tests that attack
(or use) the database as a least-privileged component would. Roles are cluster-wide:
every login made here is dropped when its block ends."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from outbox import schema as outbox_schema

# login(group, temporary=False) -> URL of this test's database as a new user in that group.
Login = Callable[..., str]


def as_user(url: str, user: str) -> str:
    """The same server and database, as ``user`` (the test cluster trusts local users)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}@{parts.hostname}:{parts.port}"))


@contextlib.contextmanager
def group_logins(postgres_server_url: str, database_url: str) -> Iterator[Login]:
    """roles.sql applied to ``database_url``; yields a maker of LOGIN users in one group.

    ``temporary=True`` grants the new user TEMPORARY on the database, which roles.sql
    revokes from everyone: what a deployment that needs temporary tables would do, and so
    what a test needs to show the functions' pinned search_path holds on its own.
    """
    with psycopg.connect(database_url) as connection:
        outbox_schema.apply_roles(connection)
    database = urlsplit(database_url).path.lstrip("/")
    made: list[tuple[str, str]] = []

    def make(group: str, *, temporary: bool = False) -> str:
        user = f"outbox_test_{group.removeprefix('outbox_')}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(postgres_server_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    sql.Identifier(user), sql.Identifier(group)
                )
            )
            made.append((user, group))
            if temporary:
                admin.execute(
                    sql.SQL("GRANT TEMPORARY ON DATABASE {} TO {}").format(
                        sql.Identifier(database), sql.Identifier(user)
                    )
                )
        return as_user(database_url, user)

    try:
        yield make
    finally:
        with psycopg.connect(postgres_server_url, autocommit=True) as admin:
            for user, group in made:
                # The database may be gone already (its fixture ended first): its grants
                # went with it. Privileges on other objects never existed.
                admin.execute(
                    sql.SQL("REVOKE {} FROM {}").format(sql.Identifier(group), sql.Identifier(user))
                )
                with psycopg.connect(database_url, autocommit=True) as own:
                    own.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(user)))
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(user)))
