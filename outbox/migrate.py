"""``outbox migrate``: create the database if it is missing, then apply ``schema.sql``
(and, with ``--roles``, ``roles.sql``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg
import psycopg.errors

from outbox import schema
from outbox.backoff import exponential_delay
from outbox.broker import Topology, connect_for_command, declare_topology
from outbox.connections import command_parameters
from outbox.errors import ConfigurationError, DatabaseError, OutboxError, connect_failure
from outbox.settings import Settings, database_name, libpq_url, redact_url, with_database

MAINTENANCE_DATABASE = "postgres"


@dataclass(frozen=True)
class MigrationReport:
    database: str
    created_database: bool
    schema_version: int
    roles: tuple[str, ...] = ()
    """The group roles granted, when roles.sql was applied."""
    schema_creators: tuple[str, ...] = ()
    """Roles other than the schema's owner still allowed to create in it, which
    ``allow_schema_creators`` let the migration finish with."""


def ensure_database(url: str) -> bool:
    """Create the URL's database when it does not exist; True if this call created it."""
    url = libpq_url(url)
    name = database_name(url)
    try:
        psycopg.connect(url, **command_parameters()).close()
        return False
    except psycopg.OperationalError as first_failure:
        try:
            with psycopg.connect(
                with_database(url, MAINTENANCE_DATABASE), autocommit=True, **command_parameters()
            ) as admin:
                if schema.database_exists(admin, name):
                    raise _unreachable(url, first_failure) from None
                return schema.create_database(admin, name)
        except psycopg.OperationalError:
            raise _unreachable(url, first_failure) from None


def _unreachable(url: str, failure: psycopg.OperationalError) -> ConfigurationError:
    return ConfigurationError(
        f"cannot connect to {redact_url(url)}: {connect_failure(failure)}. Is Postgres "
        "running, and is OUTBOX_DATABASE_URL right?"
    )


# Each try of the DDL waits this long for a table's lock: every reader and writer of
# that table queues behind the request meanwhile, so the wait is short and tried again.
LOCK_TIMEOUT_SECONDS = 1.0
LOCK_TRIES = 10


def migrate(
    url: str,
    *,
    roles: bool = False,
    allow_schema_creators: bool = False,
    lock_timeout: float = LOCK_TIMEOUT_SECONDS,
    lock_tries: int = LOCK_TRIES,
) -> MigrationReport:
    """Create the database when missing and apply ``schema.sql`` (and ``roles.sql``).

    A schema already current is left alone, without a lock on any table. A change
    waits at most ``lock_timeout`` seconds per statement for its lock, in up to
    ``lock_tries`` tries with a growing pause between them, then fails naming the
    sessions that held the schema's tables (:class:`SchemaBusy`).

    With ``roles``, a role other than the schema's owner that may still create objects
    in it (granted by name, which roles.sql does not take away) stops the migration
    before it commits, unless ``allow_schema_creators``: such a role could define what
    a careless query of the application's own resolves to.
    """
    created = ensure_database(url)
    holders: tuple[schema.LockHolder, ...] = ()
    for attempt in range(1, lock_tries + 1):
        try:
            return _migrate_once(
                url,
                created=created,
                roles=roles,
                allow_schema_creators=allow_schema_creators,
                lock_timeout=lock_timeout,
            )
        except DatabaseError as error:
            if not isinstance(error.driver_error, psycopg.errors.LockNotAvailable):
                raise
            holders = _lock_holders(url) or holders
        if attempt < lock_tries:
            time.sleep(exponential_delay(attempt, first=0.5, longest=5.0))
    raise SchemaBusy(lock_tries, lock_timeout, holders)


def _migrate_once(
    url: str, *, created: bool, roles: bool, allow_schema_creators: bool, lock_timeout: float
) -> MigrationReport:
    granted: tuple[str, ...] = ()
    creators: tuple[str, ...] = ()
    try:
        # One transaction for both files: the grants never name a table that is not
        # there yet, and a failure leaves neither half applied.
        with psycopg.connect(libpq_url(url), **command_parameters()) as connection:
            version = schema.apply_schema(connection, lock_timeout=lock_timeout)
            if roles:
                granted = schema.apply_roles(connection)
                creators = schema.schema_creators(connection)
                if creators and not allow_schema_creators:
                    raise SchemaCreatorsRefused(creators)
    except psycopg.OperationalError as failure:
        raise _unreachable(libpq_url(url), failure) from None
    return MigrationReport(
        database=database_name(libpq_url(url)),
        created_database=created,
        schema_version=version,
        roles=granted,
        schema_creators=creators,
    )


def _lock_holders(url: str) -> tuple[schema.LockHolder, ...]:
    """Who holds the schema's tables now, asked on a session of its own (the migration's
    transaction is aborted); nothing when that cannot be asked."""
    try:
        with psycopg.connect(libpq_url(url), autocommit=True, **command_parameters()) as other:
            return schema.schema_lock_holders(other)
    except (psycopg.Error, DatabaseError):
        return ()


class SchemaBusy(OutboxError):
    """``outbox migrate`` could not take a table's lock in any of its tries; nothing was
    committed."""

    def __init__(
        self, tries: int, lock_timeout: float, holders: tuple[schema.LockHolder, ...]
    ) -> None:
        self.holders = holders
        held_by = (
            "; held by " + ", ".join(str(holder) for holder in holders)
            if holders
            else "; whoever held it had let go when asked"
        )
        super().__init__(
            f"the schema's tables stayed locked: {tries} tries, each waiting {lock_timeout:g} s "
            f"for a lock{held_by}. Nothing was applied. End that transaction (or "
            "SELECT pg_terminate_backend(<pid>)) and run outbox migrate again"
        )


class SchemaCreatorsRefused(ConfigurationError):
    """``outbox migrate --roles`` found roles besides the schema's owner that may create
    objects in it; nothing was committed."""

    def __init__(self, creators: tuple[str, ...]) -> None:
        self.creators = creators
        super().__init__(
            f"roles other than the schema's owner may create objects in it: "
            f"{', '.join(creators)}. Nothing was applied. Revoke it (REVOKE CREATE ON "
            "SCHEMA <schema> FROM <role>, for each role or the group it holds it through), "
            "or run again with --allow-schema-creators to apply the migration anyway"
        )


async def declare_broker_topology(settings: Settings) -> Topology:
    """Declare the exchanges and queues both daemons require (unless they run with
    --declare-topology), and route each group of ``OUTBOX_TOOL_QUEUES`` to its queue,
    removing the routes the setting no longer names."""
    topology = Topology.from_settings(settings)
    connection = await connect_for_command(settings)
    async with connection:
        await declare_topology(await connection.channel(), topology, reroute=True)
    return topology
