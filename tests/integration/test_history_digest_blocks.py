"""A day's checkpoint digest in blocks (schema version 16, docs/operating.md "History
retention"): one string of a whole day's lines could not pass Postgres's 1 GB bound on a
value, so a day of more than about ten million operations could be neither exported
nor dropped. The database and an export's offline check compute the same blocks; a day
of one block keeps the digest it always had."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from datetime import date
from pathlib import Path
from uuid import UUID, uuid4

import pytest

from outbox import OperationState, Registry
from outbox import schema as outbox_schema
from outbox.cli import run_command
from outbox.history_file import DIGEST_BLOCK, digest, verify_archive
from outbox.operator import history_days

from support.db_helpers import execute_admin, migrate_again
from support.history_helpers import archive_all, settled_days_ago
from support.ops_helpers import Ops

S = OperationState
DAY_OPERATIONS = 7


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def heads_of(database_url: str, day: date) -> list[tuple[UUID, int, str | None]]:
    rows = execute_admin(
        database_url,
        "SELECT operation_id, event_count, last_hash FROM history WHERE settled_on = %s",
        (day,),
    )
    return [(UUID(str(op)), int(events), last) for op, events, last in rows]


def flat_digest(heads: Iterable[tuple[UUID, int, str | None]]) -> str:
    """The digest before version 16: every line of the day in one string."""
    lines = sorted(f"{op} {events} {last or '-'}" for op, events, last in heads)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def day_in_blocks(database_url: str, day: date, block: int) -> tuple[int, int, str]:
    [row] = execute_admin(
        database_url,
        "SELECT operations, events, digest FROM outbox_history_day_blocks(%s, %s)",
        (day, block),
    )
    return int(row[0]), int(row[1]), str(row[2])


@pytest.fixture
def archived(ops: Ops, database_url: str) -> tuple[date, list[tuple[UUID, int, str | None]]]:
    """Seven operations settled 40 days ago, moved into history: one day."""
    for _ in range(DAY_OPERATIONS):
        settled_days_ago(database_url, ops.at(S.COMMITTED).id, 40)
    archive_all(ops)
    [(day,)] = execute_admin(database_url, "SELECT DISTINCT settled_on FROM history")
    heads = heads_of(database_url, day)
    assert len(heads) == DAY_OPERATIONS
    return day, heads


@pytest.mark.parametrize("block", [1, 2, 3, 6])
def test_a_day_of_several_blocks_has_the_digest_an_export_check_computes(
    archived: tuple[date, list[tuple[UUID, int, str | None]]], database_url: str, block: int
) -> None:
    day, heads = archived
    events = sum(count for _, count, _ in heads)

    operations, counted, in_database = day_in_blocks(database_url, day, block)

    assert (operations, counted) == (DAY_OPERATIONS, events)
    assert in_database == digest(heads, block)
    # Several blocks: the digest of the blocks' digests, never the flat one.
    assert in_database != flat_digest(heads)
    first = sorted(heads)[:block]
    assert in_database != digest(first, block)


def test_a_day_of_one_block_keeps_the_digest_it_had_and_its_checkpoints_agree(
    archived: tuple[date, list[tuple[UUID, int, str | None]]], database_url: str
) -> None:
    day, heads = archived

    [(whole_day,)] = execute_admin(
        database_url, "SELECT digest FROM outbox_history_day(%s)", (day,)
    )
    archived_digests = execute_admin(
        database_url,
        "SELECT digest FROM history_checkpoints WHERE kind = 'archived' AND settled_on = %s",
        (day,),
    )

    assert whole_day == flat_digest(heads) == digest(heads)
    assert day_in_blocks(database_url, day, DAY_OPERATIONS)[2] == whole_day
    # One batch moved the whole day, so its checkpoint states the day's digest.
    assert archived_digests == [(whole_day,)]
    [(schema_block,)] = execute_admin(database_url, "SELECT outbox_history_digest_block()")
    assert schema_block == DIGEST_BLOCK


def test_an_empty_day_and_any_order_of_heads_give_one_digest() -> None:
    heads = [(uuid4(), n, f"{n:064x}") for n in range(1, 12)]
    shuffled = random.Random(7).sample(heads, len(heads))

    assert digest([]) == hashlib.sha256(b"").hexdigest()
    assert digest(shuffled, 4) == digest(sorted(heads), 4)
    assert digest(shuffled) == flat_digest(heads)


def test_an_empty_day_has_the_digest_of_no_lines(database_url: str) -> None:
    assert day_in_blocks(database_url, date(2001, 1, 1), 3) == (
        0,
        0,
        hashlib.sha256(b"").hexdigest(),
    )


def test_a_version_15_database_is_told_to_migrate(database_url: str) -> None:
    execute_admin(
        database_url,
        "DROP FUNCTION outbox_history_day(date);"
        "DROP FUNCTION outbox_history_day_blocks(date, integer);"
        "DELETE FROM outbox_schema_version WHERE version = 16;"
        # As another schema.sql applied it: the migration runs again.
        "UPDATE outbox_schema_applied SET digest = repeat('0', 64)",
    )
    told_to_migrate, migrated, current = migrate_again(database_url)

    assert told_to_migrate
    assert (migrated, current) == (outbox_schema.SCHEMA_VERSION, True)


def exported_day(ops: Ops, database_url: str, out: Path, count: int) -> tuple[str, Path]:
    """``count`` operations settled 40 days ago, moved, and their day exported."""
    for _ in range(count):
        settled_days_ago(database_url, ops.at(S.COMMITTED).id, 40)
    archive_all(ops)
    [(day,)] = execute_admin(database_url, "SELECT DISTINCT settled_on::text FROM history")
    env = {"OUTBOX_DATABASE_URL": database_url}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        assert run_command(["history", "export", "--day", day, "--out", str(out)]) == 0
    return day, out / f"history-{day}.jsonl"


def test_an_export_from_before_blocks_still_verifies_and_a_changed_one_does_not(
    ops: Ops, database_url: str, tmp_path: Path
) -> None:
    # Three operations hashed in one block, as every day was before version 16; read
    # back with blocks of two, as a day past 100,000 operations is now.
    _, path = exported_day(ops, database_url, tmp_path, 3)
    lines = path.read_text().splitlines()
    row = json.loads(lines[1])
    row["last_hash"] = "a" * 64
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")

    old_style = verify_archive(path, block=2)
    tampered = verify_archive(changed, block=2)

    assert old_style.digest_matches
    assert old_style.computed_digest == old_style.checkpoint.digest
    assert not tampered.digest_matches


def test_a_day_exported_before_blocks_agrees_with_verify_days(
    ops: Ops,
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    day, _ = exported_day(ops, database_url, tmp_path, 3)
    # The day now hashed in blocks of two, as one past 100,000 operations is: its digest
    # is no longer the one-block digest its export recorded.
    execute_admin(
        database_url,
        "CREATE OR REPLACE FUNCTION outbox_history_digest_block() RETURNS integer "
        "LANGUAGE sql IMMUTABLE PARALLEL SAFE RETURN 2",
    )
    monkeypatch.setattr(history_days, "DIGEST_BLOCK", 2)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    [(now,)] = execute_admin(database_url, "SELECT digest FROM outbox_history_day(%s)", (day,))
    [(recorded,)] = execute_admin(
        database_url, "SELECT digest FROM history_checkpoints WHERE kind = 'exported'"
    )

    capsys.readouterr()
    code = run_command(["history", "verify", "--days", "--json"])
    report = json.loads(capsys.readouterr().out)

    assert now != recorded
    assert code == 0
    assert [(d["settled_on"], d["verdict"]) for d in report["days"]] == [(day, "matches")]
