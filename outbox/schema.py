"""The DDL and database administration: apply ``schema.sql`` and ``roles.sql``, read
the applied schema version, and create, find and drop databases.

:mod:`outbox.migrate` (``outbox migrate``) drives these; the consumer and ``outbox mcp``
ask :func:`schema_is_current` at start, and the tests, the demo and the benchmarks make and
drop their databases here. Everything runs on a plain psycopg connection. The plain
statements are named in ``queries.sql`` and run through the store's runner, like every
other statement. Two kinds of SQL are not: the DDL scripts themselves (``schema.sql``
and ``roles.sql``, each a file of its own), and CREATE/DROP DATABASE, whose database
name is an identifier that no query parameter can carry, so they are composed here
with :mod:`psycopg.sql`.
"""

from __future__ import annotations

import hashlib
from typing import Any

import psycopg
import psycopg.errors
import psycopg.sql

from outbox.errors import ConfigurationError, DatabaseError, wrap_database_errors
from outbox.sql import roles_sql, schema_sql
from outbox.store.gauges import LockHolder as LockHolder
from outbox.store.gauges import schema_lock_holders as schema_lock_holders_plan
from outbox.store.runner import AsyncConnection, AsyncStore, Plan, Step, Store

# pg_advisory_xact_lock key shared by every migrating process ("outbox" in ASCII).
_MIGRATION_LOCK = 0x6F7574626F78

# The version schema.sql brings a database to (its last outbox_schema_version row).
SCHEMA_VERSION = 19

# What schema.sql writes where a function body names an object of the schema being
# migrated; apply_schema puts that schema's quoted name in its place.
SCHEMA_PLACEHOLDER = "@schema@"

# The NOLOGIN group roles roles.sql creates, one per component.
ROLES = (
    "outbox_agent",
    "outbox_dispatcher",
    "outbox_consumer",
    "outbox_operator",
    "outbox_callbacks",
)


def apply_schema(connection: psycopg.Connection[Any], *, lock_timeout: float | None = None) -> int:
    """Apply ``schema.sql`` in the connection's transaction; returns the schema version.

    Concurrent callers queue on an advisory lock, so two migrations never interleave.
    The schema is the connection's ``current_schema()``: the functions' bodies name its
    objects with it, since their pinned search_path holds only ``pg_catalog``.

    When this very file (its SHA-256, schema name included) was the last applied and the
    schema is current, nothing is applied and no table is locked. Otherwise each
    statement waits at most ``lock_timeout`` seconds for its lock, when given, and then
    raises :class:`~outbox.errors.DatabaseError` (its ``driver_error`` a
    ``LockNotAvailable``) for the caller to try again (:func:`outbox.migrate.migrate`
    does, and names who held the lock).
    """
    runner = Store(connection, require_transaction=False)
    runner.run(_take_migration_lock())
    ddl = schema_ddl(connection, runner.run(_current_schema()))
    digest = hashlib.sha256(ddl.encode()).hexdigest()
    if runner.run(_applied_digest()) == digest and runner.run(_schema_is_current()):
        return runner.run(_schema_version()) or 0
    if lock_timeout is not None:
        runner.run(_set_lock_timeout(lock_timeout))
    with wrap_database_errors("apply_schema"):
        connection.execute(ddl.encode())
    runner.run(_record_digest(digest))
    return runner.run(_schema_version()) or 0


def schema_lock_holders(connection: psycopg.Connection[Any]) -> tuple[LockHolder, ...]:
    """The other sessions holding a lock on a table of the connection's schema, longest
    open first (at most five): who a migration that timed out waited for."""
    return Store(connection, require_transaction=False).run(schema_lock_holders_plan())


def schema_ddl(connection: psycopg.Connection[Any], schema: str) -> str:
    """``schema.sql`` for ``schema``: its quoted name wherever a function body names one
    of the schema's objects (:data:`SCHEMA_PLACEHOLDER`)."""
    quoted = psycopg.sql.Identifier(schema).as_string(connection)
    return schema_sql().replace(SCHEMA_PLACEHOLDER, quoted)


def apply_roles(connection: psycopg.Connection[Any]) -> tuple[str, ...]:
    """Apply ``roles.sql`` in the connection's transaction; returns the group roles.

    Run it after :func:`apply_schema` (the grants name its tables), usually in the same
    transaction. It queues on the same advisory lock, so it never interleaves with a
    migration of this database.
    """
    Store(connection, require_transaction=False).run(_take_migration_lock())
    with wrap_database_errors("apply_roles"):
        connection.execute(roles_sql().encode())
    return ROLES


def schema_creators(connection: psycopg.Connection[Any]) -> tuple[str, ...]:
    """The roles besides the schema's owner (its members, superusers) that may create
    objects in the connection's schema, after :func:`apply_roles` revoked it from PUBLIC
    and the groups: each holds it by name, or through a role that does."""
    return Store(connection, require_transaction=False).run(_schema_creators())


def schema_version(connection: psycopg.Connection[Any]) -> int | None:
    """The highest applied schema version, or None when the schema is absent."""
    return Store(connection, require_transaction=False).run(_schema_version())


def schema_is_current(connection: psycopg.Connection[Any]) -> bool:
    """Whether this library's schema is applied: the newest table, function and column
    it needs exist (so a database at an older version is told to migrate). Asks the
    catalog only, which needs no grant, so a least-privilege role can tell too."""
    return Store(connection, require_transaction=False).run(_schema_is_current())


async def schema_is_current_async(connection: AsyncConnection) -> bool:
    """:func:`schema_is_current` on an async connection (``outbox mcp``, at start)."""
    store = await AsyncStore.on(connection, require_transaction=False)
    return await store.run(_schema_is_current())


def create_database(
    connection: psycopg.Connection[Any], name: str, *, template: str | None = None
) -> bool:
    """CREATE DATABASE on an autocommit connection; False if it already existed."""
    statement = psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name))
    if template is not None:
        statement += psycopg.sql.SQL(" TEMPLATE {}").format(psycopg.sql.Identifier(template))
    try:
        with wrap_database_errors("create_database"):
            connection.execute(statement)
    except DatabaseError as error:
        if isinstance(error.driver_error, psycopg.errors.DuplicateDatabase):
            return False
        raise
    return True


def drop_database(connection: psycopg.Connection[Any], name: str) -> None:
    """DROP DATABASE IF EXISTS ... WITH (FORCE), on an autocommit connection."""
    statement = psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
        psycopg.sql.Identifier(name)
    )
    with wrap_database_errors("drop_database"):
        connection.execute(statement)


def database_exists(connection: psycopg.Connection[Any], name: str) -> bool:
    return Store(connection, require_transaction=False).run(_database_exists(name))


def _take_migration_lock() -> Plan[None]:
    yield Step("take_migration_lock", {"key": _MIGRATION_LOCK})


def _current_schema() -> Plan[str]:
    rows = yield Step("current_schema", {})
    schema: str | None = rows[0]["schema"]
    if schema is None:
        raise ConfigurationError(
            "this connection has no schema to migrate: none of its search_path exists "
            "(create the schema, or set search_path in the database URL's options)"
        )
    return schema


def _applied_digest() -> Plan[str | None]:
    rows = yield Step("has_schema_digest_table", {})
    if not rows[0]["present"]:
        return None
    rows = yield Step("applied_schema_digest", {})
    return str(rows[0]["digest"]) if rows else None


def _record_digest(digest: str) -> Plan[None]:
    yield Step("record_schema_digest", {"digest": digest})


def _set_lock_timeout(seconds: float) -> Plan[None]:
    yield Step("set_lock_timeout", {"lock_timeout": f"{max(1, round(seconds * 1000))}ms"})


def _schema_creators() -> Plan[tuple[str, ...]]:
    rows = yield Step("schema_creators", {})
    return tuple(str(row["role"]) for row in rows)


def _schema_version() -> Plan[int | None]:
    rows = yield Step("has_schema_version_table", {})
    if not rows[0]["present"]:
        return None
    rows = yield Step("schema_version", {})
    version: int | None = rows[0]["version"]
    return version


def _schema_is_current() -> Plan[bool]:
    rows = yield Step("schema_is_current", {})
    return bool(rows[0]["is_current"])


def _database_exists(name: str) -> Plan[bool]:
    rows = yield Step("database_exists", {"name": name})
    return bool(rows)
