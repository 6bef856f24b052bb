"""History retention and the roles: an operator moves, exports and reads history; only
the tables' owner drops a day of it; no agent, dispatcher, consumer or callbacks login can
move, detach, drop or forget anything of it, nor delete evidence by claiming to be the
move."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import psycopg.errors
import pytest

from outbox import Operation, Registry
from outbox import store as outbox_store
from outbox.cli import run_command

from support.db_helpers import execute_admin
from support.logins import Login
from support.logs import Ran, statements_seen
from support.ops_helpers import Ops
from support.roles_cases import (
    AGENT,
    CALLBACKS,
    COMPONENT_QUERIES,
    CONSUMER,
    DISPATCHER,
    HISTORY,
    HISTORY_DROP,
    OPERATOR,
    S,
    run,
)


@pytest.fixture
def ran() -> Iterator[Ran]:
    with statements_seen() as seen:
        yield seen


def settled_long_ago(database_url: str, registry: Registry, days: int = 200) -> Operation:
    operation = Ops(database_url, registry).at(S.COMMITTED)
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET updated_at = now() - make_interval(days => %s) WHERE id = %s",
            (days, operation.id),
        )
        connection.execute(
            "UPDATE outbox SET published_at = now() WHERE operation_id = %s", (operation.id,)
        )
    return operation


def a_day_of_history(roles_database: str, registry: Registry) -> tuple[Operation, str]:
    """One operation moved into history by the owner; its day's partition."""
    operation = settled_long_ago(roles_database, registry)
    assert run(roles_database, outbox_store.archive_batch(timedelta(days=1), 10))
    partition = execute_admin(
        roles_database,
        "SELECT 'history_p' || to_char(settled_on, 'YYYYMMDD') FROM history "
        "WHERE operation_id = %s",
        (operation.id,),
    )[0][0]
    return operation, str(partition)


ATTEMPTS = {
    "archive": "SELECT * FROM outbox_history_archive(interval '0', 10)",
    "detach": "ALTER TABLE history DETACH PARTITION {partition}",
    "detach concurrently": "ALTER TABLE history DETACH PARTITION {partition} CONCURRENTLY",
    "drop": "DROP TABLE {partition}",
    "forget keys": "SELECT outbox_history_rotate_keys(interval '1 second')",
    "truncate keys": "TRUNCATE history_keys_0",
    "dropped checkpoint": "SELECT * FROM outbox_history_checkpoint(current_date, 'dropped')",
    "make a partition": "SELECT outbox_history_partition(current_date + 1000)",
    "delete history": "DELETE FROM history",
    "delete evidence as the move": "SELECT set_config('outbox.history_move', 'on', false); "
    "DELETE FROM operation_events",
    # The checkpoint chain (version 14): written by the owner's functions alone.
    "change a checkpoint": "UPDATE history_checkpoints SET operations = 0",
    "delete a checkpoint": "DELETE FROM history_checkpoints",
    "forge a checkpoint": "INSERT INTO history_checkpoints (kind, settled_on, operations, "
    "events, digest) VALUES ('archived', current_date, 0, 0, repeat('0', 64))",
    "truncate checkpoints": "TRUNCATE history_checkpoints",
    "move the checkpoint head": "UPDATE history_checkpoint_head SET checkpoints = 0",
    "lock the checkpoint head": "SELECT 1 FROM history_checkpoint_head FOR UPDATE",
}


@pytest.mark.parametrize("group", [AGENT, DISPATCHER, CONSUMER, CALLBACKS, OPERATOR])
def test_no_component_login_can_drop_detach_or_forget_history(
    login: Login, roles_database: str, registry: Registry, group: str
) -> None:
    operation, partition = a_day_of_history(roles_database, registry)
    hot = Ops(roles_database, registry).new()
    url = login(group)
    refused = {}
    for what, statement in ATTEMPTS.items():
        if group == OPERATOR and what == "archive":
            continue  # the operator's to run: below
        with psycopg.connect(url, autocommit=True) as connection:
            try:
                connection.execute(statement.format(partition=partition))
            except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedTable) as error:
                refused[what] = type(error).__name__
            else:
                refused[what] = "done"

    assert all(outcome == "InsufficientPrivilege" for outcome in refused.values()), refused
    assert execute_admin(
        roles_database, "SELECT count(*) FROM history WHERE operation_id = %s", (operation.id,)
    ) == [(1,)]
    assert run(roles_database, outbox_store.verify_checkpoints()).intact
    assert execute_admin(
        roles_database, "SELECT count(*) FROM operation_events WHERE operation_id = %s", (hot.id,)
    ) == [(1,)]


def test_the_operator_moves_exports_and_reads_history_and_the_owner_drops_it(
    login: Login,
    roles_database: str,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    ran: Ran,
) -> None:
    operation = settled_long_ago(roles_database, registry)
    operator = login(OPERATOR)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", operator)

    codes = [run_command(["history", "archive", "--hot", "1d"])]
    day = execute_admin(
        roles_database,
        "SELECT settled_on::text FROM history WHERE operation_id = %s",
        (operation.id,),
    )[0][0]
    codes += [
        run_command(["history", "status"]),
        run_command(["history", "export", "--day", day, "--out", str(tmp_path)]),
        run_command(["ops", "show", operation.display_id]),
        run_command(["ops", "verify", operation.display_id]),
        run_command(["history", "verify"]),
        run_command(["ops", "verify", "--archive", str(tmp_path / f"history-{day}.jsonl")]),
    ]
    operator_drop = run_command(["history", "drop", "--retention", "30d"])
    monkeypatch.setenv("OUTBOX_DATABASE_URL", roles_database)
    codes.append(
        run_command(["history", "drop", "--retention", "30d", "--export-dir", str(tmp_path / "d")])
    )
    output = capsys.readouterr()

    assert codes == [0] * len(codes), output.err
    assert operator_drop == 2
    assert "history drop runs as the owner of the outbox tables" in output.err
    assert "lock time" in output.out
    assert execute_admin(roles_database, "SELECT count(*) FROM history") == [(0,)]
    assert COMPONENT_QUERIES[HISTORY] <= ran.by(urlsplit(operator).username)
    assert COMPONENT_QUERIES[HISTORY_DROP] <= ran.by(urlsplit(roles_database).username)
