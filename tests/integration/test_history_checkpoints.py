"""The checkpoint chain (schema version 14, docs/operating.md "History retention"): every
checkpoint row links to the one before it and the head counts them, so a row the
tables' owner changed or deleted is found by `outbox history verify`; and an export's
checkpoint line is compared with the database's row when the database can be reached,
so a forged file with a forged line is refused there (and said to be offline-only
evidence when no database is asked)."""

from __future__ import annotations

import dataclasses
import json
import threading
from datetime import date
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from outbox import OperationState, Registry
from outbox import schema as outbox_schema
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.history_file import digest, load_line
from outbox.store import Store

from support.db_helpers import execute_admin
from support.history_helpers import (
    archive_all,
    archived_day,
    settled_days_ago,
    wait_for_lock_waiters,
)
from support.ops_helpers import Ops
from support.ports import closed_port

S = OperationState


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


@pytest.fixture
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)


def checkpoints(database_url: str) -> list[tuple[Any, ...]]:
    """(id, seq, kind, prev_hash, hash) in chain order."""
    return execute_admin(
        database_url,
        "SELECT id, seq, kind, encode(prev_hash, 'hex'), encode(hash, 'hex') "
        "FROM history_checkpoints ORDER BY seq",
    )


def four_checkpoints(ops: Ops, database_url: str) -> list[tuple[Any, ...]]:
    """Operations settled on two days, moved in batches of one: four archived rows."""
    for days in (40, 40, 41, 41):
        settled_days_ago(database_url, ops.at(S.COMMITTED).id, days)
    assert len(archive_all(ops, batch=1)) == 4
    return checkpoints(database_url)


def as_owner(database_url: str, statement: str, params: tuple[Any, ...] = ()) -> None:
    """What the tables' owner can do and no login of the application can: switch the
    append-only trigger off for one statement."""
    with psycopg.connect(database_url) as connection:
        connection.execute(
            "ALTER TABLE history_checkpoints DISABLE TRIGGER history_checkpoints_append_only"
        )
        connection.execute(statement, params or None)
        connection.execute(
            "ALTER TABLE history_checkpoints ENABLE TRIGGER history_checkpoints_append_only"
        )


def history_verify(capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = run_command(["history", "verify", "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_every_checkpoint_links_to_the_one_before_and_verify_says_so(
    ops: Ops, database_url: str, cli: None, capsys: pytest.CaptureFixture[str]
) -> None:
    chain = four_checkpoints(ops, database_url)
    code, report = history_verify(capsys)
    text_code = run_command(["history", "verify"])
    text = capsys.readouterr().out

    assert [seq for _, seq, *_ in chain] == [1, 2, 3, 4]
    assert chain[0][3] is None
    assert [row[3] for row in chain[1:]] == [row[4] for row in chain[:-1]]
    assert execute_admin(
        database_url, "SELECT checkpoints, encode(last_hash, 'hex') FROM history_checkpoint_head"
    ) == [(4, chain[-1][4])]
    assert (code, text_code) == (0, 0)
    assert report == {
        "intact": True,
        "checkpoints_checked": 4,
        "first_broken": None,
        "broken": [],
    }
    assert "checkpoint chain intact: 4 checkpoint(s)" in text


def test_no_one_changes_a_checkpoint_while_the_trigger_is_on(ops: Ops, database_url: str) -> None:
    four_checkpoints(ops, database_url)

    for statement in (
        "UPDATE history_checkpoints SET events = 0",
        "DELETE FROM history_checkpoints",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="append-only"):
            execute_admin(database_url, statement)
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="chain trigger"):
        execute_admin(database_url, "UPDATE history_checkpoint_head SET checkpoints = 1")


# What the owner did with the append-only trigger off, and the first link verify names:
# (seq, whether it names that seq's row or the head, reason).
TAMPERING = {
    "a row's counts changed": (
        "UPDATE history_checkpoints SET operations = operations + 1 WHERE seq = 2",
        (2, "row", "hash_mismatch"),
    ),
    "a row changed and its hash recomputed": (
        "UPDATE history_checkpoints SET digest = repeat('0', 64) WHERE seq = 2;"
        "UPDATE history_checkpoints SET hash = outbox_checkpoint_hash(id, seq, kind, "
        "settled_on, operations, events, digest, recorded_by, recorded_at, prev_hash) "
        "WHERE seq = 2",
        (3, "row", "prev_mismatch"),
    ),
    "a middle row deleted": (
        "DELETE FROM history_checkpoints WHERE seq = 2",
        (3, "row", "prev_mismatch"),
    ),
    "the first row deleted": (
        "DELETE FROM history_checkpoints WHERE seq = 1",
        (2, "row", "prev_mismatch"),
    ),
    "the newest row deleted": (
        "DELETE FROM history_checkpoints WHERE seq = 4",
        (4, "head", "missing_tail"),
    ),
    "a row added past the head": (
        "INSERT INTO history_checkpoints (kind, settled_on, operations, events, digest, seq, "
        "prev_hash, hash) SELECT kind, settled_on, operations, events, digest, 5, hash, hash "
        "FROM history_checkpoints WHERE seq = 4",
        (5, "row", "anchor_mismatch"),
    ),
}


@pytest.mark.parametrize("tampering", TAMPERING, ids=list(TAMPERING))
def test_a_checkpoint_the_owner_changed_or_deleted_is_the_first_broken_link(
    ops: Ops,
    database_url: str,
    cli: None,
    capsys: pytest.CaptureFixture[str],
    tampering: str,
) -> None:
    chain = four_checkpoints(ops, database_url)
    statement, (seq, names, reason) = TAMPERING[tampering]
    if "INSERT" in statement:
        # Added around the chain trigger too: nothing would link it otherwise.
        with psycopg.connect(database_url) as connection:
            connection.execute(
                "ALTER TABLE history_checkpoints DISABLE TRIGGER history_checkpoints_chain"
            )
            connection.execute(statement)
            connection.execute(
                "ALTER TABLE history_checkpoints ENABLE TRIGGER history_checkpoints_chain"
            )
    else:
        as_owner(database_url, statement)
    ids = {row[1]: row[0] for row in checkpoints(database_url)}

    code, report = history_verify(capsys)
    text_code = run_command(["history", "verify"])
    text = capsys.readouterr().out

    assert (code, text_code) == (1, 1)
    assert report["intact"] is False
    assert report["first_broken"] == {
        "seq": seq,
        "checkpoint_id": ids[seq] if names == "row" else None,
        "reason": reason,
    }
    assert f"checkpoint chain BROKEN: first broken link at seq {seq}" in text
    assert reason in text
    assert len(chain) == 4


def test_two_checkpoints_written_at_once_chain_one_after_the_other(
    ops: Ops, database_url: str
) -> None:
    # The second waits for the first's hold on the head, then chains after it.
    recorded: dict[str, Any] = {}

    def second() -> None:
        recorded["second"] = ops.run(outbox_store.checkpoint_day(date(2026, 1, 2), "exported"))

    with psycopg.connect(database_url) as first:
        Store(first).run(outbox_store.checkpoint_day(date(2026, 1, 1), "exported"))
        racer = threading.Thread(target=second)
        racer.start()
        wait_for_lock_waiters(database_url, "the second checkpoint waiting for the head")
    racer.join(10)

    assert [(row[1], row[2]) for row in checkpoints(database_url)] == [
        (1, "exported"),
        (2, "exported"),
    ]
    assert recorded["second"].seq == 2
    assert ops.run(outbox_store.verify_checkpoints()) == outbox_store.CheckpointChainReport(2, ())


# --- ops verify --archive against the database --------------------------------------


def exported(ops: Ops, database_url: str, directory: Path) -> tuple[Path, list[str]]:
    """A day of three operations, archived and exported; the file and its lines."""
    operations = [ops.at(S.COMMITTED) for _ in range(3)]
    for operation in operations:
        settled_days_ago(database_url, operation.id, 60)
    archive_all(ops)
    day = archived_day(database_url, operations[0].id)
    assert run_command(["history", "export", "--day", day, "--out", str(directory)]) == 0
    path = directory / f"history-{day}.jsonl"
    return path, path.read_text().splitlines()


def forged(directory: Path, lines: list[str], *, keep_row_names: bool = True) -> Path:
    """The export without its last operation, and a checkpoint line that agrees with
    what is left: what someone who can write the file can make."""
    rows = [load_line(line) for line in lines[1:-1]]
    head = json.loads(lines[0])
    head["checkpoint"].update(
        operations=len(rows),
        events=sum(int(row["event_count"]) for row in rows),
        digest=digest(
            (UUID(str(row["operation_id"])), int(row["event_count"]), row["last_hash"])
            for row in rows
        ),
    )
    if not keep_row_names:
        for name in ("id", "seq", "prev_hash", "hash"):
            head["checkpoint"].pop(name)
    path = directory / ("forged.jsonl" if keep_row_names else "forged-old-style.jsonl")
    path.write_text("\n".join([json.dumps(head), *lines[1:-1]]) + "\n")
    return path


def test_a_genuine_export_is_confirmed_by_the_database(
    ops: Ops,
    database_url: str,
    cli: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, lines = exported(ops, database_url, tmp_path)
    line = json.loads(lines[0])["checkpoint"]
    capsys.readouterr()

    code = run_command(["ops", "verify", "--archive", str(path), "--json"])
    report = json.loads(capsys.readouterr().out)
    text_code = run_command(["ops", "verify", "--archive", str(path)])
    text = capsys.readouterr().out

    assert (code, text_code) == (0, 0)
    assert report["intact"] is True
    assert report["evidence"] == "database"
    assert report["database"]["confirmed"] is True
    assert report["database"]["checkpoint"]["id"] == line["id"]
    assert report["database"]["checkpoint"]["hash"] == line["hash"]
    assert report["database"]["chain_intact"] is True
    assert f"database: checkpoint #{line['id']} (seq {line['seq']}, exported" in text
    assert "checkpoint chain intact" in text
    assert "offline-only" not in text


def test_a_forged_export_with_a_forged_checkpoint_line_is_refused_online_only(
    ops: Ops,
    database_url: str,
    cli: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, lines = exported(ops, database_url, tmp_path)
    forgery = forged(tmp_path, lines)
    old_style = forged(tmp_path, lines, keep_row_names=False)
    capsys.readouterr()

    offline = run_command(["ops", "verify", "--archive", str(forgery), "--offline"])
    offline_text = capsys.readouterr().out
    online = run_command(["ops", "verify", "--archive", str(forgery), "--json"])
    online_report = json.loads(capsys.readouterr().out)
    named_by_digest = run_command(["ops", "verify", "--archive", str(old_style)])
    named_by_digest_text = capsys.readouterr().out

    # On its own the forgery holds together: that is all an offline check can say.
    assert offline == 0
    assert "offline-only evidence" in offline_text
    assert online == 1
    assert online_report["intact"] is False
    assert online_report["digest_matches"] is True
    assert online_report["database"]["confirmed"] is False
    assert [d.split(" ")[0] for d in online_report["database"]["differences"]] == [
        "operations",
        "events",
        "digest",
    ]
    assert named_by_digest == 1
    assert "database: MISMATCH, no checkpoint of" in named_by_digest_text


def test_an_export_whose_checkpoint_chain_was_broken_is_not_confirmed(
    ops: Ops,
    database_url: str,
    cli: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = exported(ops, database_url, tmp_path)
    as_owner(database_url, "DELETE FROM history_checkpoints WHERE seq = 1")
    capsys.readouterr()

    code = run_command(["ops", "verify", "--archive", str(path)])
    text = capsys.readouterr().out

    assert code == 1
    assert "states the same day, counts and digest" in text
    assert "database: checkpoint chain BROKEN: first broken link at seq 2" in text


def test_an_export_is_checked_offline_and_said_so_when_the_database_is_unreachable(
    ops: Ops,
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    path, _ = exported(ops, database_url, tmp_path)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"postgresql://nobody@127.0.0.1:{closed_port()}/x")
    capsys.readouterr()

    code = run_command(["ops", "verify", "--archive", str(path), "--json"])
    report = json.loads(capsys.readouterr().out)
    text_code = run_command(["ops", "verify", "--archive", str(path)])
    text = capsys.readouterr().out

    assert (code, text_code) == (0, 0)
    assert run_command(["ops", "verify", "--all", "--offline"]) == 2
    assert "--offline goes with --archive" in capsys.readouterr().err
    assert report["evidence"] == "offline"
    assert report["database"] is None
    assert "could not be reached" in report["offline_reason"]
    assert "offline-only evidence" in text


# --- the export records its checkpoint, then reads the day in a snapshot of its own ---


def test_an_export_that_raced_an_archive_batch_records_again_and_writes_what_it_read(
    ops: Ops,
    database_url: str,
    cli: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    first = ops.at(S.COMMITTED)
    settled_days_ago(database_url, first.id, 70)
    late = ops.at(S.COMMITTED)
    settled_days_ago(database_url, late.id, 70, published=False)
    archive_all(ops)
    day = archived_day(database_url, first.id)
    reads: list[date] = []
    real = outbox_store.day_digest

    def racing(read_day: date) -> Any:
        if not reads:
            # Between the checkpoint's commit and the snapshot: a batch adds to the day.
            execute_admin(
                database_url,
                "UPDATE outbox SET published_at = now() WHERE operation_id = %s",
                (late.id,),
            )
            archive_all(ops)
        reads.append(read_day)
        return (yield from real(read_day))

    monkeypatch.setattr(outbox_store, "day_digest", racing)
    code = run_command(["history", "export", "--day", day, "--out", str(tmp_path)])
    monkeypatch.undo()
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    path = tmp_path / f"history-{day}.jsonl"
    line = json.loads(path.read_text().splitlines()[0])["checkpoint"]
    capsys.readouterr()

    assert code == 0
    assert len(reads) == 2
    assert execute_admin(
        database_url,
        "SELECT kind, operations FROM history_checkpoints WHERE settled_on = %s::date ORDER BY seq",
        (day,),
    ) == [("archived", 1), ("exported", 1), ("archived", 1), ("exported", 2)]
    assert line["operations"] == 2
    assert len(path.read_text().splitlines()) == 3
    assert run_command(["ops", "verify", "--archive", str(path)]) == 0


def test_an_export_of_a_day_that_never_holds_still_writes_nothing(
    ops: Ops,
    database_url: str,
    cli: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    operation = ops.at(S.COMMITTED)
    settled_days_ago(database_url, operation.id, 70)
    archive_all(ops)
    day = archived_day(database_url, operation.id)
    real = outbox_store.day_digest

    def always_changed(read_day: date) -> Any:
        seen = yield from real(read_day)
        return dataclasses.replace(seen, operations=seen.operations + 1)

    monkeypatch.setattr(outbox_store, "day_digest", always_changed)
    capsys.readouterr()
    code = run_command(["history", "export", "--day", day, "--out", str(tmp_path)])
    err = capsys.readouterr().err

    assert code == 1
    assert "kept changing while it was exported (3 tries" in err
    assert list(tmp_path.iterdir()) == []
    assert execute_admin(
        database_url,
        "SELECT count(*) FROM history_checkpoints WHERE kind = 'exported'",
    ) == [(3,)]


# --- migrating a version 13 database -------------------------------------------------


def as_version_13(database_url: str) -> None:
    """As a version 13 database looks: checkpoints unchained, no head, the checkpoint
    function with its old result, executable by the operators; no version 14."""
    execute_admin(
        database_url,
        "DROP TRIGGER history_checkpoints_chain ON history_checkpoints;"
        "DROP FUNCTION outbox_chain_checkpoint();"
        "DROP TABLE history_checkpoint_head;"
        "DROP FUNCTION outbox_checkpoint_head_guard();"
        "ALTER TABLE history_checkpoints DROP COLUMN seq, DROP COLUMN prev_hash, "
        "DROP COLUMN hash;"
        "DROP FUNCTION outbox_checkpoint_hash(bigint, bigint, text, date, integer, bigint, "
        "text, name, timestamptz, bytea);"
        "DROP FUNCTION outbox_history_checkpoint(date, text);"
        "CREATE FUNCTION outbox_history_checkpoint(p_day date, p_kind text) RETURNS TABLE "
        "(settled_on date, operations integer, events bigint, digest text, recorded_by name, "
        "recorded_at timestamptz) LANGUAGE sql AS $$ SELECT p_day, 0, 0::bigint, "
        "repeat('0', 64), current_user, now() $$;"
        "REVOKE ALL ON FUNCTION outbox_history_checkpoint(date, text) FROM PUBLIC;"
        "GRANT EXECUTE ON FUNCTION outbox_history_checkpoint(date, text) TO outbox_operator;"
        "DELETE FROM outbox_schema_version WHERE version = 14",
    )
    for day in ("2026-03-02", "2026-03-01", "2026-03-03"):
        execute_admin(
            database_url,
            "INSERT INTO history_checkpoints (kind, settled_on, operations, events, digest) "
            "VALUES ('archived', %s, 1, 2, repeat('a', 64))",
            (day,),
        )


def test_migrating_a_version_13_database_chains_its_checkpoints_and_keeps_the_grants(
    ops: Ops, database_url: str
) -> None:
    with psycopg.connect(database_url) as connection:
        outbox_schema.apply_roles(connection)
    as_version_13(database_url)
    with psycopg.connect(database_url) as connection:
        assert not outbox_schema.schema_is_current(connection)
    ids = [row[0] for row in execute_admin(database_url, "SELECT id FROM history_checkpoints")]

    with psycopg.connect(database_url) as connection:
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
    chain = checkpoints(database_url)
    with psycopg.connect(database_url) as connection:
        assert outbox_schema.schema_is_current(connection)
        assert outbox_schema.apply_schema(connection) == outbox_schema.SCHEMA_VERSION
    ops.run(outbox_store.checkpoint_day(date(2026, 3, 4), "exported"))

    assert [(row[0], row[1]) for row in chain] == list(zip(sorted(ids), [1, 2, 3], strict=True))
    assert checkpoints(database_url)[:3] == chain
    assert ops.run(outbox_store.verify_checkpoints()) == outbox_store.CheckpointChainReport(4, ())
    assert execute_admin(
        database_url,
        "SELECT has_function_privilege('outbox_operator', "
        "'outbox_history_checkpoint(date, text)', 'EXECUTE'), "
        "has_function_privilege('outbox_agent', "
        "'outbox_history_checkpoint(date, text)', 'EXECUTE')",
    ) == [(True, False)]
