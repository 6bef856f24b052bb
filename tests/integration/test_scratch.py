"""ScratchEnvironment and ScratchDatabase: a run's own database and broker names, made
and removed, after a failure too; delete_topology with names that are already gone."""

from __future__ import annotations

import asyncio

import aio_pika
import aiormq.exceptions
import psycopg
import pytest
from pydantic import SecretStr

from outbox import Settings
from outbox.broker import Topology, delete_topology
from outbox.sandbox.scratch import ScratchDatabase, ScratchEnvironment, topology_named
from outbox.schema import database_exists, schema_version
from outbox.settings import with_database

from support.ports import closed_port


@pytest.fixture
def server_settings(postgres_server_url: str, amqp_server_url: str) -> Settings:
    return Settings(
        database_url=SecretStr(postgres_server_url), amqp_url=SecretStr(amqp_server_url)
    )


def database_is_there(server_url: str, name: str) -> bool:
    with psycopg.connect(server_url, autocommit=True) as admin:
        return database_exists(admin, name)


async def existing_queues(amqp_url: str, topology: Topology) -> list[str]:
    existing = []
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        for queue in (topology.queue, topology.dead_letter_queue):
            # A passive declare of a missing queue closes its channel: one channel each.
            try:
                await (await connection.channel()).get_queue(queue, ensure=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                continue
            existing.append(queue)
    return existing


def test_a_scratch_environment_is_made_then_removed_after_a_failure(
    server_settings: Settings, postgres_server_url: str, amqp_server_url: str
) -> None:
    scratch = ScratchEnvironment.unique(server_settings, "test")
    name, topology = scratch.database.name, scratch.topology

    def run_that_fails() -> None:
        with scratch:
            assert name == f"outbox_test_{scratch.tag}"
            assert topology.queue == f"test.{scratch.tag}.operations"
            assert scratch.settings.queue == topology.queue
            assert scratch.settings.database_url.get_secret_value() == scratch.database_url
            with psycopg.connect(scratch.database_url) as connection:
                assert schema_version(connection) is not None
            assert asyncio.run(existing_queues(amqp_server_url, topology)) == [
                topology.queue,
                topology.dead_letter_queue,
            ]
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        run_that_fails()

    assert not database_is_there(postgres_server_url, name)
    assert asyncio.run(existing_queues(amqp_server_url, topology)) == []


def test_a_kept_scratch_environment_stays_for_a_person_to_look_at(
    server_settings: Settings, postgres_server_url: str, amqp_server_url: str
) -> None:
    scratch = ScratchEnvironment.unique(server_settings, "test")
    try:
        with scratch:
            scratch.keep()

        assert database_is_there(postgres_server_url, scratch.database.name)
        assert asyncio.run(existing_queues(amqp_server_url, scratch.topology)) != []
    finally:
        scratch.kept = False
        assert scratch.remove() == []
    assert not database_is_there(postgres_server_url, scratch.database.name)


def test_names_the_daemons_declare_themselves_are_removed_all_the_same(
    server_settings: Settings, postgres_server_url: str, amqp_server_url: str
) -> None:
    with ScratchEnvironment.unique(server_settings, "test", declare_topology=False) as scratch:
        assert asyncio.run(existing_queues(amqp_server_url, scratch.topology)) == []
        assert database_is_there(postgres_server_url, scratch.database.name)

    assert not database_is_there(postgres_server_url, scratch.database.name)


def test_what_cannot_be_removed_is_said_without_the_password(server_settings: Settings) -> None:
    unreachable_port = closed_port()
    nowhere = server_settings.model_copy(
        update={
            "database_url": SecretStr(
                f"postgresql://someone:s3cret-canary@127.0.0.1:{unreachable_port}/x"
            ),
            "amqp_url": SecretStr(f"amqp://guest:s3cret-canary@127.0.0.1:{unreachable_port}/"),
        }
    )
    scratch = ScratchEnvironment.unique(nowhere, "test")

    problems = scratch.remove()

    assert len(problems) == 2
    assert problems[0].startswith("could not drop postgresql://someone:***@127.0.0.1:")
    assert problems[1].startswith(f"could not delete the queues {scratch.topology.queue} and ")
    assert "s3cret-canary" not in " ".join(problems)


def test_a_scratch_database_copies_a_template_or_starts_empty(
    postgres_server_url: str, template_database: str
) -> None:
    with (
        ScratchDatabase.unique(
            postgres_server_url, "outbox_test_copy", template=template_database
        ) as copy,
        psycopg.connect(copy.url) as connection,
    ):
        assert schema_version(connection) is not None
    with ScratchDatabase.unique(
        postgres_server_url, "outbox_test_empty", apply_schema=False
    ) as empty:
        assert empty.url == with_database(postgres_server_url, empty.name)
        with psycopg.connect(empty.url) as connection:
            assert schema_version(connection) is None

    assert not database_is_there(postgres_server_url, copy.name)
    assert not database_is_there(postgres_server_url, empty.name)


def test_recreate_starts_over_under_the_same_name(postgres_server_url: str) -> None:
    database = ScratchDatabase.unique(postgres_server_url, "outbox_test_again")
    try:
        database.create()
        with psycopg.connect(database.url, autocommit=True) as connection:
            connection.execute("CREATE TABLE left_behind ()")

        database.recreate()

        with psycopg.connect(database.url) as connection:
            row = connection.execute("SELECT to_regclass('left_behind')").fetchone()
        assert row == (None,)
    finally:
        database.drop()


async def test_deleting_names_that_are_gone_is_fine(amqp_server_url: str) -> None:
    topology = topology_named("test.never-declared")

    await delete_topology(amqp_server_url, topology)
    await delete_topology(amqp_server_url, topology)
