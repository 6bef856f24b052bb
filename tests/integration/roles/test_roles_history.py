"""History retention and the roles: an operator moves, exports and reads history; only
the tables' owner drops a day of it; no agent, dispatcher, consumer or callbacks login can
move, detach, drop or forget anything of it, nor delete evidence by claiming to be the
move."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import psycopg.errors
import pytest

from outbox import (
    Operation,
    OutcomeStatus,
    Registry,
    await_outcome,
    await_outcome_sync,
    record_decision,
)
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.errors import OperationNotFound

from support.db_helpers import execute_admin
from support.history_helpers import settled_days_ago
from support.logins import Login
from support.logs import Ran, statements_seen
from support.ops_helpers import Ops
from support.roles_cases import (
    AGENT,
    AWAIT_ARCHIVED,
    CALLBACKS,
    COMPONENT_QUERIES,
    CONSUMER,
    DISPATCHER,
    HISTORY,
    HISTORY_DROP,
    OPERATOR,
    S,
    advance,
    run,
)


@pytest.fixture
def ran() -> Iterator[Ran]:
    with statements_seen() as seen:
        yield seen


def settled_long_ago(database_url: str, registry: Registry, days: int = 200) -> Operation:
    operation = Ops(database_url, registry).at(S.COMMITTED)
    settled_days_ago(database_url, operation.id, days)
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
    # A drop that stopped after its checkpoint: status counts that day's rows.
    execute_admin(roles_database, "SELECT * FROM outbox_history_checkpoint(%s, 'dropped')", (day,))
    codes += [
        run_command(["history", "status"]),
        run_command(["history", "export", "--day", day, "--out", str(tmp_path)]),
        run_command(["ops", "show", operation.display_id[:11]]),
        run_command(["ops", "list", "--archived"]),
        run_command(["ops", "verify", operation.display_id]),
        run_command(["history", "verify"]),
        run_command(["history", "verify", "--days"]),
        run_command(["ops", "verify", "--archive", str(tmp_path / f"history-{day}.jsonl")]),
    ]
    # What a dead letter's view reads of an operation that moved.
    archived_states = run(operator, outbox_store.archived_states([operation.id]))
    # What `history verify --days` reads of a day exported before version 16.
    flat = run(operator, outbox_store.day_digest(date.fromisoformat(day), flat=True))
    # An archived operation is the operator's to read, not to change: refused by name.
    refused = run_command(
        ["ops", "resolve", operation.display_id, "--rejected", "--evidence", "e", "--by", "a"]
    )
    refusal = capsys.readouterr().err
    operator_drop = run_command(["history", "drop", "--retention", "30d"])
    monkeypatch.setenv("OUTBOX_DATABASE_URL", roles_database)
    codes.append(
        run_command(["history", "drop", "--retention", "30d", "--export-dir", str(tmp_path / "d")])
    )
    output = capsys.readouterr()

    assert codes == [0] * len(codes), output.err
    assert refused == 1
    assert archived_states == {operation.id: S.COMMITTED}
    assert flat.operations == 1
    assert f"{operation.display_id} is archived" in refusal
    assert operator_drop == 2
    assert "history drop runs as the owner of the outbox tables" in output.err
    assert "lock time" in output.out
    assert execute_admin(roles_database, "SELECT count(*) FROM history") == [(0,)]
    assert COMPONENT_QUERIES[HISTORY] <= ran.by(urlsplit(operator).username)
    assert COMPONENT_QUERIES[HISTORY_DROP] <= ran.by(urlsplit(roles_database).username)


def test_the_agent_awaits_an_archived_outcome_and_reads_nothing_else_of_history(
    login: Login, roles_database: str, registry: Registry, ran: Ran
) -> None:
    agent = login(AGENT)
    refund = {"payment_id": "pay_1", "amount_cents": 100}
    with psycopg.connect(agent) as connection:
        keyed = record_decision(
            connection, registry, "send_refund", refund, run_id="r", decision_key="k"
        )
    with psycopg.connect(agent) as connection:
        keyless = record_decision(connection, registry, "send_refund", refund, run_id="r")
    for recorded in (keyed, keyless):
        advance(roles_database, recorded.operation, S.IN_FLIGHT, S.COMMITTED)
        settled_days_ago(roles_database, recorded.operation.id, 3)
    assert run(roles_database, outbox_store.archive_batch(timedelta(days=1), 10))
    ran.records.clear()

    by_id = await_outcome_sync(agent, keyed.operation.id, timeout=0)
    by_key = asyncio.run(await_outcome(agent, keyed, timeout=0))
    with pytest.raises(OperationNotFound, match="recorded without a decision key"):
        await_outcome_sync(agent, keyless.operation.id, timeout=0)
    # The key rows it reads (version 17: the operation's columns, typed) hold its id and
    # outcome, and nothing of the input.
    with psycopg.connect(agent) as connection:
        keys = connection.execute(
            "SELECT to_jsonb(g)::text FROM history_keys_0 g UNION ALL "
            "SELECT to_jsonb(g)::text FROM history_keys_1 g"
        ).fetchall()
    refused = {}
    for column in ("operation", "events", "callbacks", "approvals", "state", "settled_at"):
        with psycopg.connect(agent, autocommit=True) as connection:
            try:
                connection.execute(f"SELECT {column} FROM history")
            except psycopg.errors.InsufficientPrivilege:
                refused[column] = True

    assert (by_id.status, by_key.status) == (OutcomeStatus.COMMITTED, OutcomeStatus.COMMITTED)
    assert by_id.provider_reference == by_key.provider_reference
    assert by_id.operation_id == keyed.operation.id
    assert len(keys) == 1
    assert str(keyed.operation.id) in keys[0][0]
    assert "pay_1" not in keys[0][0]
    assert '"input"' not in keys[0][0]
    assert refused == dict.fromkeys(refused, True)
    assert len(refused) == 6
    assert ran.by(urlsplit(agent).username) == {
        "listen_operation_changes",
        "operation_outcomes",
        "operation_outcomes_changed",
        *COMPONENT_QUERIES[AWAIT_ARCHIVED],
    }
