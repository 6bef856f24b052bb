"""An event names an operation that exists (schema version 19): checked by the evidence
chain's trigger, where a foreign key used to look the operation up and lock it for every
event. An event naming no operation is refused as the foreign key refused it
(foreign_key_violation, the same name) and nothing is written; an append racing the
move of its operation into history either moves with it or is refused, never left
naming an operation that is gone; a version 18 database loses the foreign key on
migrating."""

from __future__ import annotations

from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest
from psycopg.types.json import Jsonb

from outbox import OperationState, Registry
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.errors import OutboxError
from outbox.states import EventName
from outbox.store import Store

from support.db_helpers import execute_admin, migrate_again
from support.history_helpers import HOT, race_an_open_batch, settled_days_ago
from support.ops_helpers import Ops

S = OperationState
APPEND = (
    "INSERT INTO operation_events (operation_id, name, attributes) "
    "VALUES (%s, 'operation.note', '{}')"
)
FOREIGN_KEYS_ON_EVENTS = (
    "SELECT count(*) FROM pg_constraint "
    "WHERE conrelid = 'operation_events'::regclass AND contype = 'f'"
)


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def trail(database_url: str, operation_id: UUID) -> tuple[int, int]:
    """How many events and heads name ``operation_id``."""
    rows = execute_admin(
        database_url,
        "SELECT (SELECT count(*) FROM operation_events WHERE operation_id = %s),"
        " (SELECT count(*) FROM operation_event_heads WHERE operation_id = %s)",
        (operation_id, operation_id),
    )
    return int(rows[0][0]), int(rows[0][1])


def refused_constraint(database_url: str, sql: str, params: tuple[Any, ...]) -> str | None:
    with (
        pytest.raises(psycopg.errors.ForeignKeyViolation) as refused,
        psycopg.connect(database_url, autocommit=True) as connection,
    ):
        connection.execute(sql, params)
    return refused.value.diag.constraint_name


@pytest.mark.parametrize("name", ["operation.note", "operation.prepared", "agent.completed"])
def test_an_event_naming_no_operation_is_refused_and_leaves_nothing(
    database_url: str, name: str
) -> None:
    nobody = uuid4()

    refused = refused_constraint(
        database_url,
        "INSERT INTO operation_events (operation_id, name, attributes) VALUES (%s, %s, %s)",
        (nobody, name, Jsonb({})),
    )

    assert refused == "operation_events_operation_id_fkey"
    assert trail(database_url, nobody) == (0, 0)


def test_the_store_appending_for_an_unknown_operation_is_refused(
    ops: Ops, database_url: str
) -> None:
    known = ops.new()
    unknown = known.model_copy(update={"id": uuid4()})

    with pytest.raises(OutboxError) as refused:
        ops.run(outbox_store.append_event(unknown, EventName.WAITING, {}))

    assert isinstance(refused.value.driver_error, psycopg.errors.ForeignKeyViolation)
    assert trail(database_url, unknown.id) == (0, 0)
    assert trail(database_url, known.id) == (1, 1)


def test_events_of_operations_that_exist_chain_with_no_foreign_key_left(
    ops: Ops, database_url: str
) -> None:
    operation = ops.at(S.COMMITTED)

    assert execute_admin(database_url, FOREIGN_KEYS_ON_EVENTS) == [(0,)]
    events, heads = trail(database_url, operation.id)
    assert (events, heads) == (3, 1)
    assert execute_admin(
        database_url,
        "SELECT events FROM operation_event_heads WHERE operation_id = %s",
        (operation.id,),
    ) == [(3,)]


def test_an_append_holding_the_head_keeps_its_operation_out_of_the_batch_until_it_commits(
    ops: Ops, database_url: str
) -> None:
    held = ops.at(S.COMMITTED)
    free = ops.at(S.COMMITTED)
    for operation in (held, free):
        settled_days_ago(database_url, operation.id, 2)

    with psycopg.connect(database_url) as appender:
        appender.execute(APPEND, (held.id,))
        with psycopg.connect(database_url) as mover:
            first = Store(mover).run(outbox_store.archive_batch(HOT, 10))
    with psycopg.connect(database_url) as mover:
        second = Store(mover).run(outbox_store.archive_batch(HOT, 10))

    assert sum(checkpoint.operations for checkpoint in first) == 1
    assert sum(checkpoint.operations for checkpoint in second) == 1
    # The event the appender committed moved with its operation, and nothing is left.
    assert execute_admin(
        database_url, "SELECT event_count FROM history WHERE operation_id = %s", (held.id,)
    ) == [(4,)]
    assert trail(database_url, held.id) == (0, 0)
    assert trail(database_url, free.id) == (0, 0)


def test_an_append_waiting_for_the_move_is_refused_once_its_operation_is_gone(
    ops: Ops, database_url: str
) -> None:
    operation = ops.at(S.COMMITTED)
    settled_days_ago(database_url, operation.id, 2)
    outcome: dict[str, Any] = {}

    def append() -> None:
        try:
            with psycopg.connect(database_url, autocommit=True) as appender:
                appender.execute(APPEND, (operation.id,))
            outcome["appended"] = True
        except psycopg.Error as error:
            outcome["error"] = error

    # The move has deleted the operation and its head and not committed: the append
    # waits for the head, then finds it gone.
    finished = race_an_open_batch(database_url, append, "the append waiting for the move")

    assert finished
    assert isinstance(outcome.get("error"), psycopg.errors.ForeignKeyViolation), outcome
    assert trail(database_url, operation.id) == (0, 0)
    assert execute_admin(
        database_url, "SELECT event_count FROM history WHERE operation_id = %s", (operation.id,)
    ) == [(3,)]


def test_a_version_18_database_loses_the_foreign_key_and_still_refuses_an_orphan(
    ops: Ops, database_url: str
) -> None:
    operation = ops.new()
    execute_admin(
        database_url,
        "ALTER TABLE operation_events ADD CONSTRAINT operation_events_operation_id_fkey "
        "FOREIGN KEY (operation_id) REFERENCES operations (id)"
        "; DELETE FROM outbox_schema_version WHERE version = 19"
        # As another schema.sql applied it: the migration runs again.
        "; UPDATE outbox_schema_applied SET digest = repeat('0', 64)",
    )
    told_to_migrate, migrated, current = migrate_again(database_url)

    assert told_to_migrate
    assert (migrated, current) == (outbox_schema.SCHEMA_VERSION, True)
    assert execute_admin(database_url, FOREIGN_KEYS_ON_EVENTS) == [(0,)]
    assert refused_constraint(database_url, APPEND, (uuid4(),)) == (
        "operation_events_operation_id_fkey"
    )
    execute_admin(database_url, APPEND, (operation.id,))
    assert trail(database_url, operation.id) == (2, 1)
