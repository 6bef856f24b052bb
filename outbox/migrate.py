"""``outbox migrate``: create the database if it is missing, then apply ``schema.sql``
(and, with ``--roles``, ``roles.sql``)."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from outbox import schema
from outbox.broker import Topology, connect_for_command, declare_topology
from outbox.connections import command_parameters
from outbox.errors import ConfigurationError, connect_failure
from outbox.settings import Settings, database_name, libpq_url, redact_url, with_database

MAINTENANCE_DATABASE = "postgres"


@dataclass(frozen=True)
class MigrationReport:
    database: str
    created_database: bool
    schema_version: int
    roles: tuple[str, ...] = ()
    """The group roles granted, when roles.sql was applied."""


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


def migrate(url: str, *, roles: bool = False) -> MigrationReport:
    created = ensure_database(url)
    granted: tuple[str, ...] = ()
    try:
        # One transaction for both files: the grants never name a table that is not
        # there yet, and a failure leaves neither half applied.
        with psycopg.connect(libpq_url(url), **command_parameters()) as connection:
            version = schema.apply_schema(connection)
            if roles:
                granted = schema.apply_roles(connection)
    except psycopg.OperationalError as failure:
        raise _unreachable(libpq_url(url), failure) from None
    return MigrationReport(
        database=database_name(libpq_url(url)),
        created_database=created,
        schema_version=version,
        roles=granted,
    )


async def declare_broker_topology(settings: Settings) -> Topology:
    """Declare the exchanges and queues both daemons require (unless they run with
    --declare-topology)."""
    topology = Topology.from_settings(settings)
    connection = await connect_for_command(settings)
    async with connection:
        await declare_topology(await connection.channel(), topology)
    return topology
