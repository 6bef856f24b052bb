"""A database and broker names of one run's own, and their removal.

``outbox demo``, the chaos harness, the benchmarks and the tests each work in a database
and under broker names nobody else uses, and remove them at the end, after a failure
too: this is where such names are made up, created and removed. Removing drops a
database and deletes queues with their messages, so only names made for one run are
ever handed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import aiormq.exceptions
import psycopg
from pydantic import SecretStr

from outbox.broker import Topology, delete_topology
from outbox.connections import command_parameters
from outbox.errors import ConfigurationError, OutboxError, connect_failure
from outbox.migrate import MAINTENANCE_DATABASE, declare_broker_topology, migrate
from outbox.schema import create_database, drop_database
from outbox.settings import Settings, database_name, libpq_url, redact_url, with_database

DEFAULT_DELIVERY_LIMIT = int(Settings.model_fields["delivery_limit"].default)


class LeftBehind(OutboxError):
    """Part of a run's database or broker names could not be removed."""


def new_tag() -> str:
    """What ties the names of one run together (eight hex digits)."""
    return uuid.uuid4().hex[:8]


def topology_named(prefix: str, *, delivery_limit: int = DEFAULT_DELIVERY_LIMIT) -> Topology:
    """Broker names under ``prefix``, shaped like the default ones (``outbox``,
    ``outbox.operations``, ``outbox.dead``, ``outbox.operations.dead``)."""
    return Topology(
        exchange=f"{prefix}.outbox",
        queue=f"{prefix}.operations",
        dead_letter_exchange=f"{prefix}.dead",
        dead_letter_queue=f"{prefix}.operations.dead",
        delivery_limit=delivery_limit,
    )


class ScratchDatabase:
    """A database of one run's own: created with the schema applied, as a copy of
    ``template``, or empty (``apply_schema=False``); dropped at the end. As a context
    manager: created on entry, dropped on exit, after a failure too.

    ``admin_url`` names a database on the same server to connect to for CREATE and
    DROP DATABASE (usually the server's ``postgres``).
    """

    def __init__(
        self,
        admin_url: str,
        name: str,
        *,
        template: str | None = None,
        apply_schema: bool = True,
    ) -> None:
        self.admin_url = libpq_url(admin_url)
        self.name = name
        self.template = template
        # A copy of the template has the template's schema already.
        self.apply_schema = apply_schema and template is None

    @classmethod
    def unique(
        cls,
        admin_url: str,
        prefix: str,
        *,
        template: str | None = None,
        apply_schema: bool = True,
    ) -> ScratchDatabase:
        """``<prefix>_<tag>``, a name no other run uses."""
        return cls(admin_url, f"{prefix}_{new_tag()}", template=template, apply_schema=apply_schema)

    @property
    def url(self) -> str:
        return with_database(self.admin_url, self.name)

    def create(self) -> str:
        """Create the database and apply the schema; its URL. A database that cannot
        have the schema applied is dropped again before the error goes on."""
        with self._admin() as admin:
            if not create_database(admin, self.name, template=self.template):
                raise ConfigurationError(
                    f"database {self.name!r} exists already: it is not this run's to use"
                )
        if self.apply_schema:
            try:
                migrate(self.url)
            except BaseException:
                with contextlib.suppress(OutboxError, psycopg.Error, OSError):
                    self.drop()
                raise
        return self.url

    def recreate(self) -> str:
        """Drop the database if it exists, then create it: a clean start under a name
        that is the same each time (a benchmark's, given on its command line)."""
        self.drop()
        return self.create()

    def drop(self) -> None:
        """Drop the database if it exists, ending any session still connected to it."""
        with self._admin() as admin:
            drop_database(admin, self.name)

    def __enter__(self) -> ScratchDatabase:
        self.create()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.drop()

    @contextlib.contextmanager
    def _admin(self) -> Iterator[psycopg.Connection[Any]]:
        try:
            connection = psycopg.connect(self.admin_url, autocommit=True, **command_parameters())
        except psycopg.OperationalError as failure:
            raise ConfigurationError(
                f"cannot connect to {redact_url(self.admin_url)}: {connect_failure(failure)}. "
                "Is Postgres running, and is OUTBOX_DATABASE_URL right?"
            ) from None
        with connection:
            yield connection


class ScratchEnvironment:
    """A database and broker names of one run's own, named by ``settings`` (which
    :meth:`unique` makes up). :meth:`create` makes the database with the schema applied
    and, unless the run's daemons declare it themselves, declares the topology as
    ``outbox migrate --broker`` does; :meth:`remove` drops the database and deletes the
    topology, each whatever became of the other, unless :meth:`keep` was called first.
    As a context manager: created on entry, removed on exit, after a failure too.

    Synchronous (it runs the broker's calls to completion itself): from a coroutine,
    use :func:`outbox.broker.delete_topology` and :class:`ScratchDatabase` directly.
    """

    def __init__(self, settings: Settings, *, declare_topology: bool = True, tag: str = "") -> None:
        self.settings = settings
        self.declare_topology = declare_topology
        self.tag = tag
        url = settings.libpq_url
        self.database = ScratchDatabase(
            with_database(url, MAINTENANCE_DATABASE), database_name(url)
        )
        self.topology = Topology.from_settings(settings)
        self.kept = False

    @classmethod
    def unique(
        cls, settings: Settings, prefix: str, *, declare_topology: bool = True
    ) -> ScratchEnvironment:
        """``settings`` with a database ``outbox_<prefix>_<tag>`` on the same server and
        broker names ``<prefix>.<tag>.*``, where no other run has them."""
        tag = new_tag()
        names = topology_named(f"{prefix}.{tag}", delivery_limit=settings.delivery_limit)
        database_url = with_database(settings.libpq_url, f"outbox_{prefix}_{tag}")
        named = settings.model_copy(
            update={
                "database_url": SecretStr(database_url),
                "exchange": names.exchange,
                "queue": names.queue,
                "dead_letter_exchange": names.dead_letter_exchange,
                "dead_letter_queue": names.dead_letter_queue,
            }
        )
        return cls(named, declare_topology=declare_topology, tag=tag)

    @property
    def database_url(self) -> str:
        return self.database.url

    @property
    def amqp_url(self) -> str:
        return self.settings.amqp_url.get_secret_value()

    def create(self) -> None:
        """Create the database, then declare the topology; if that fails, drop the
        database again before the error goes on (nothing is left to remove)."""
        self.database.create()
        if not self.declare_topology:
            return
        try:
            asyncio.run(declare_broker_topology(self.settings))
        except BaseException:
            with contextlib.suppress(OutboxError, psycopg.Error, OSError):
                self.database.drop()
            raise

    def remove(self) -> list[str]:
        """Drop the database and delete the topology (queues with their messages), each
        tried whatever became of the other; one line for each that stays, fit to print
        (no password in it). Nothing is removed once :meth:`keep` was called."""
        if self.kept:
            return []
        problems: list[str] = []
        try:
            self.database.drop()
        except (OutboxError, psycopg.Error, OSError) as failure:
            problems.append(
                f"could not drop {redact_url(self.database_url)}: {type(failure).__name__}"
            )
        try:
            asyncio.run(delete_topology(self.amqp_url, self.topology))
        except (OSError, aiormq.exceptions.AMQPError) as failure:
            problems.append(
                f"could not delete the queues {self.topology.queue} and "
                f"{self.topology.dead_letter_queue}: {type(failure).__name__}"
            )
        return problems

    def keep(self) -> None:
        """Leave the database and the broker names in place: the evidence of a run that
        failed, for a person to look at (and remove)."""
        self.kept = True

    def __enter__(self) -> ScratchEnvironment:
        self.create()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        problems = self.remove()
        # An error already on its way out says more than what it left behind.
        if problems and kind is None:
            raise LeftBehind("; ".join(problems))
