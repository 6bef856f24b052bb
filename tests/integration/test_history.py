"""History retention (schema version 13, docs/operating.md "History retention"): settled
operations leave the hot tables whole, into history, and a decision whose key was
archived is never recorded twice; what is never moved stays; the chain of a moved
operation still verifies, from the database and from an export."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from outbox import OperationState, Registry, record_decision
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.errors import DatabaseError, TransientDatabaseError
from outbox.history_file import broken_links, load_line
from outbox.models import ApprovalDecision
from outbox.states import EventName

from support.db_helpers import execute_admin
from support.history_helpers import (
    archive_all,
    archived_day,
    race_an_open_batch,
    settled_days_ago,
)
from support.ops_helpers import Ops

S = OperationState


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def hot_rows(database_url: str, operation_id: UUID) -> dict[str, int]:
    counts = {}
    for table in (
        "operations",
        "outbox",
        "operation_events",
        "operation_event_heads",
        "approvals",
        "callbacks",
        "agent_reports",
    ):
        column = "id" if table == "operations" else "operation_id"
        counts[table] = execute_admin(
            database_url, f"SELECT count(*) FROM {table} WHERE {column} = %s", (operation_id,)
        )[0][0]
    return counts


def recorded(database_url: str, registry: Registry, key: str, amount: int = 100) -> Any:
    with psycopg.connect(database_url) as connection:
        return record_decision(
            connection,
            registry,
            "send_refund",
            {"payment_id": "pay_1", "amount_cents": amount, "reason": ""},
            run_id="run-history",
            decision_key=key,
        )


def test_a_decision_whose_key_was_archived_returns_the_archived_operation(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    first = recorded(database_url, registry, "refund-1")
    operation = ops.move(ops.move(first.operation, S.IN_FLIGHT), S.COMMITTED)
    settled_days_ago(database_url, operation.id, 2)

    checkpoints = archive_all(ops)
    again = recorded(database_url, registry, "refund-1")

    assert first.created
    assert [c.operations for c in checkpoints] == [1]
    assert hot_rows(database_url, operation.id) == dict.fromkeys(
        hot_rows(database_url, operation.id), 0
    )
    assert again.created is False
    assert again.operation.id == operation.id
    assert again.operation.state is S.COMMITTED
    assert execute_admin(
        database_url,
        "SELECT count(*) FROM operations o JOIN outbox x ON x.operation_id = o.id "
        "WHERE o.run_id = 'run-history'",
    ) == [(0,)]


def test_a_changed_intent_under_an_archived_key_is_refused(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    first = recorded(database_url, registry, "refund-2")
    operation = ops.move(ops.move(first.operation, S.IN_FLIGHT), S.REJECTED)
    settled_days_ago(database_url, operation.id, 2)
    archive_all(ops)

    with pytest.raises(Exception, match="decision key already recorded"):
        recorded(database_url, registry, "refund-2", amount=999)

    assert execute_admin(
        database_url, "SELECT count(*) FROM operations WHERE run_id = 'run-history'"
    ) == [(0,)]


def test_only_settled_operations_past_the_hot_window_move(ops: Ops, database_url: str) -> None:
    kept = {
        state: ops.at(state) for state in (S.PREPARED, S.IN_FLIGHT, S.OUTCOME_UNKNOWN, S.ESCALATED)
    }
    recent = ops.at(S.COMMITTED)
    old = ops.at(S.COMMITTED)
    for operation in (*kept.values(), old):
        settled_days_ago(database_url, operation.id, 30)

    archive_all(ops)

    assert hot_rows(database_url, old.id)["operations"] == 0
    for operation in (*kept.values(), recent):
        assert hot_rows(database_url, operation.id)["operations"] == 1
        assert ops.run(outbox_store.verify_chain(operation.id)).intact


def test_an_archived_operation_keeps_its_whole_evidence_and_its_chain_verifies(
    ops: Ops, database_url: str
) -> None:
    operation = ops.new()
    # Attributes whose jsonb text form the Python hash must rebuild exactly: a decimal
    # with its scale, nesting, escapes, a key of two bytes for one character.
    attributes: dict[str, Any] = {
        "policy": "x",
        "n": 1.50,
        "deep": {"é\n": [1, None, True], "a": '\u0001"\\'},
    }
    ops.run(outbox_store.append_event(operation, EventName.APPROVAL_REQUIRED, attributes))
    ops.run(
        outbox_store.decide_approval(
            operation.id,
            decision=ApprovalDecision.GRANTED,
            approved_by="lead@example.com",
            ttl=timedelta(hours=1),
        )
    )
    operation = ops.move(ops.move(operation, S.IN_FLIGHT), S.COMMITTED)
    before = execute_admin(
        database_url,
        "SELECT id, seq, encode(hash, 'hex') FROM operation_events "
        "WHERE operation_id = %s ORDER BY seq",
        (operation.id,),
    )
    settled_days_ago(database_url, operation.id, 3)

    archive_all(ops)
    line = ops.run(outbox_store.archived_operation(operation.id))
    row = load_line(line)

    assert [(e["id"], e["seq"], e["hash"]) for e in row["events"]] == before
    assert len(row["approvals"]) == 1
    assert row["event_count"] == len(before)
    assert broken_links(row) == []


def test_a_changed_archived_event_is_found(ops: Ops, database_url: str) -> None:
    operation = ops.move(ops.move(ops.new(), S.IN_FLIGHT), S.COMMITTED)
    settled_days_ago(database_url, operation.id, 3)
    archive_all(ops)
    row = load_line(ops.run(outbox_store.archived_operation(operation.id)))

    row["events"][1]["attributes"]["attempt"] = 7
    links = broken_links(row)

    assert [(link.event_id, link.reason) for link in links] == [
        (row["events"][1]["id"], "hash_mismatch")
    ]


def test_archive_export_verify_and_drop_from_the_command_line(
    ops: Ops,
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    old = [ops.at(S.COMMITTED) for _ in range(3)]
    for operation in old:
        settled_days_ago(database_url, operation.id, 200)
    recent = ops.at(S.COMMITTED)

    archived = run_command(["history", "archive", "--hot", "1d", "--batch", "2"])
    archive_out = capsys.readouterr().out
    day = archived_day(database_url, old[0].id)
    shown = run_command(["ops", "show", old[0].display_id])
    verified = run_command(["ops", "verify", old[0].display_id])
    show_out = capsys.readouterr().out
    exported = run_command(["history", "export", "--day", day, "--out", str(tmp_path)])
    export = tmp_path / f"history-{day}.jsonl"
    offline = run_command(["ops", "verify", "--archive", str(export), "--json"])
    offline_out = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    dropped = run_command(["history", "drop", "--retention", "30d"])
    drop_out = capsys.readouterr().out
    gone = run_command(["ops", "verify", old[0].display_id])

    assert [archived, shown, verified, exported, offline, dropped] == [0] * 6
    assert "moved 3 settled operation(s)" in archive_out
    assert "archived" in show_out
    assert "evidence chain intact" in show_out
    assert offline_out["intact"]
    assert offline_out["digest_matches"]
    assert offline_out["operations_checked"] == 3
    assert f"{day}: dropped 3 operation(s)" in drop_out
    assert "lock time" in drop_out
    assert gone == 2
    assert execute_admin(database_url, "SELECT count(*) FROM history") == [(0,)]
    assert execute_admin(
        database_url,
        "SELECT kind, operations FROM history_checkpoints WHERE settled_on = %s::date ORDER BY id",
        (day,),
    ) == [("archived", 2), ("archived", 1), ("exported", 3), ("dropped", 3)]
    assert ops.run(outbox_store.verify_chain(recent.id)).intact
    # The export still proves what left, without the database.
    assert run_command(["ops", "verify", "--archive", str(export)]) == 0


def test_a_tampered_export_fails_verification(
    ops: Ops,
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    for operation in [ops.at(S.COMMITTED), ops.at(S.REJECTED)]:
        settled_days_ago(database_url, operation.id, 50)
    assert run_command(["history", "archive"]) == 0
    day = archived_day(database_url, operation.id)
    assert run_command(["history", "export", "--day", day, "--out", str(tmp_path)]) == 0
    lines = (tmp_path / f"history-{day}.jsonl").read_text().splitlines()
    capsys.readouterr()

    changed = tmp_path / "changed.jsonl"
    row = load_line(lines[1])
    row["events"][-1]["name"] = "operation.committed" if row["state"] == "rejected" else "x.y"
    changed.write_text("\n".join([lines[0], json.dumps(row, default=str), lines[2]]) + "\n")
    dropped_line = tmp_path / "dropped.jsonl"
    dropped_line.write_text("\n".join(lines[:2]) + "\n")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n")

    assert run_command(["ops", "verify", "--archive", str(changed)]) == 1
    assert "hash_mismatch" in capsys.readouterr().out
    assert run_command(["ops", "verify", "--archive", str(dropped_line)]) == 1
    assert "checkpoint MISMATCH" in capsys.readouterr().out
    assert run_command(["ops", "verify", "--archive", str(garbage)]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_a_hot_window_not_shorter_than_the_retention_is_refused(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_HISTORY_HOT", "P30D")
    monkeypatch.setenv("OUTBOX_HISTORY_RETENTION", "P30D")

    assert run_command(["history", "archive"]) == 2
    assert "OUTBOX_HISTORY_HOT" in capsys.readouterr().err
    monkeypatch.delenv("OUTBOX_HISTORY_HOT")
    assert run_command(["history", "archive", "--hot", "40d"]) == 2
    assert "must be shorter than the retention" in capsys.readouterr().err
    assert run_command(["history", "drop", "--retention", "1d"]) == 2
    assert execute_admin(database_url, "SELECT count(*) FROM history_checkpoints") == [(0,)]


def test_a_decision_racing_the_move_of_its_key_is_refused_and_its_retry_gets_the_archived_one(
    ops: Ops, database_url: str, registry: Registry
) -> None:
    first = recorded(database_url, registry, "refund-race")
    operation = ops.move(ops.move(first.operation, S.IN_FLIGHT), S.COMMITTED)
    settled_days_ago(database_url, operation.id, 2)
    outcome: dict[str, Any] = {}

    def retry() -> None:
        try:
            outcome["recorded"] = recorded(database_url, registry, "refund-race")
        except Exception as error:  # the test judges it
            outcome["error"] = error

    # The move has deleted the hot row and written the key, and not committed: the retry
    # finds no key, and its insert waits for the move's transaction.
    finished = race_an_open_batch(database_url, retry, "the retried decision waiting for the move")
    again = recorded(database_url, registry, "refund-race")

    assert finished
    assert isinstance(outcome.get("error"), TransientDatabaseError), outcome
    assert again.created is False
    assert again.operation.id == operation.id
    assert execute_admin(
        database_url, "SELECT count(*) FROM operations WHERE run_id = 'run-history'"
    ) == [(0,)]


def test_an_operation_that_is_not_quiet_stays_until_it_is(ops: Ops, database_url: str) -> None:
    unpublished = ops.at(S.COMMITTED)
    reported = ops.at(S.COMMITTED)
    reporting = ops.at(S.COMMITTED)
    for operation in (unpublished, reported, reporting):
        settled_days_ago(database_url, operation.id, 5)
    execute_admin(
        database_url,
        "UPDATE outbox SET published_at = NULL WHERE operation_id = %s",
        (unpublished.id,),
    )
    ops.run(outbox_store.report_agent_completed(reported.id, {"agent.outcome": "done"}))

    # An agent's report on it is being recorded: its lock is held until that commits.
    with psycopg.connect(database_url) as agent:
        agent.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('outbox.agent_reports:' || %s, 0))",
            (str(reporting.id),),
        )
        assert archive_all(ops) == []
    moved = archive_all(ops)  # the lock let go: what is quiet now moves
    # A report that comes after the move finds no operation, and leaves nothing behind.
    with pytest.raises(DatabaseError, match="agent_reports_operation"):
        ops.run(outbox_store.report_agent_completed(reporting.id, {"agent.outcome": "late"}))

    assert [checkpoint.operations for checkpoint in moved] == [1]
    assert hot_rows(database_url, unpublished.id)["operations"] == 1
    assert hot_rows(database_url, reported.id)["operations"] == 1
    assert hot_rows(database_url, reporting.id)["operations"] == 0
