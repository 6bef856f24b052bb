"""`outbox history verify --days` / `--day D` (docs/operating.md "History retention"): the
checkpoint chain proves the checkpoints unchanged; these compare each day's rows with
them, so a row deleted or rewritten in a partition, or a partition dropped without its
checkpoint, shows (exit 1) where the chain alone still verifies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from outbox import OperationState, Registry
from outbox.cli import run_command

from support.db_helpers import execute_admin
from support.history_helpers import archive_all, settled_days_ago
from support.ops_helpers import Ops

S = OperationState
DELETE_FIRST = "DELETE FROM history WHERE operation_id = {first}"


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


@pytest.fixture(autouse=True)
def cli(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)


def settle(ops: Ops, database_url: str, days: int, count: int) -> None:
    for _ in range(count):
        settled_days_ago(database_url, ops.at(S.COMMITTED).id, days)


def days_in_history(database_url: str) -> list[str]:
    rows = execute_admin(database_url, "SELECT DISTINCT settled_on::text FROM history ORDER BY 1")
    return [str(day) for (day,) in rows]


def one_archived_day(ops: Ops, database_url: str, count: int, change: str = "") -> str:
    """``count`` operations settled 40 days ago, moved in one batch; then ``change``,
    which the tables' owner runs against the first of them (``{first}``)."""
    settle(ops, database_url, 40, count)
    archive_all(ops)
    [day] = days_in_history(database_url)
    if change:
        first = "(SELECT operation_id FROM history ORDER BY operation_id LIMIT 1)"
        execute_admin(database_url, change.format(first=first))
    return day


def two_archived_days(ops: Ops, database_url: str, newer: int, older: int) -> list[str]:
    """Operations settled 40 and 41 days ago, moved in one batch: two days, oldest first."""
    settle(ops, database_url, 40, newer)
    settle(ops, database_url, 41, older)
    archive_all(ops)
    return days_in_history(database_url)


def verify(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = run_command(["history", "verify", "--json", *extra])
    captured = capsys.readouterr()
    assert captured.out, captured.err
    return code, json.loads(captured.out)


def verify_text(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = run_command(["history", "verify", *extra])
    return code, capsys.readouterr().out


def test_days_moved_in_one_batch_agree_with_their_counts_and_digest(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    two_archived_days(ops, database_url, 3, 2)
    archived = dict(
        execute_admin(
            database_url,
            "SELECT settled_on::text, id FROM history_checkpoints WHERE kind = 'archived'",
        )
    )

    code, report = verify(capsys, "--days")
    text_code, text = verify_text(capsys, "--days")

    assert (code, text_code) == (0, 0)
    assert report["intact"] is True
    assert (report["days_checked"], report["days_failed"]) == (2, 0)
    assert [(d["settled_on"], d["verdict"], d["operations"]) for d in report["days"]] == [
        (day, "matches", count) for day, count in zip(sorted(archived), (2, 3), strict=True)
    ]
    assert [d["digest_compared_with"] for d in report["days"]] == [
        archived[day] for day in sorted(archived)
    ]
    assert f"digest matches checkpoint #{archived[sorted(archived)[0]]}" in text
    assert "2 day(s) compared with their checkpoints: every one agrees" in text


def test_a_row_deleted_from_a_partition_shows_though_the_chain_verifies(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    day = one_archived_day(ops, database_url, 3, DELETE_FIRST)

    chain_only, _ = verify(capsys)
    code, report = verify(capsys, "--day", day)
    text_code, text = verify_text(capsys, "--days")

    assert chain_only == 0  # the checkpoints themselves are untouched
    assert (code, text_code) == (1, 1)
    assert report["intact"] is False
    [found] = report["days"]
    assert (found["verdict"], found["operations"], found["recorded_operations"]) == (
        "mismatch",
        2,
        3,
    )
    assert any("its archived checkpoints recorded 3" in problem for problem in found["problems"])
    assert any("digest" in problem for problem in found["problems"])
    assert f"day {day}: MISMATCH, it holds 2 operation(s)" in text
    assert "1 DISAGREE" in text


def test_a_rewritten_head_with_the_same_counts_shows_by_its_digest(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    one_archived_day(
        ops,
        database_url,
        2,
        "UPDATE history SET last_hash = repeat('a', 64) WHERE operation_id = {first}",
    )

    code, report = verify(capsys, "--days")

    assert code == 1
    [found] = report["days"]
    assert found["verdict"] == "mismatch"
    assert (found["operations"], found["recorded_operations"]) == (2, 2)
    assert len(found["problems"]) == 1
    assert "is not checkpoint #" in found["problems"][0]


def test_a_day_moved_in_batches_compares_counts_until_an_export_states_it_whole(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    settle(ops, database_url, 40, 3)
    archive_all(ops, batch=1)
    [day] = days_in_history(database_url)

    before_code, before = verify(capsys, "--days")
    _, before_text = verify_text(capsys, "--days")
    assert run_command(["history", "export", "--day", day, "--out", str(tmp_path)]) == 0
    [(export_id,)] = execute_admin(
        database_url, "SELECT id FROM history_checkpoints WHERE kind = 'exported'"
    )
    after_code, after = verify(capsys, "--days")

    assert (before_code, after_code) == (0, 0)
    assert before["days"][0]["verdict"] == "matches"
    assert before["days"][0]["digest_compared_with"] is None
    assert "counts only" in before_text
    assert after["days"][0]["digest_compared_with"] == export_id


def test_an_export_taken_after_a_row_went_missing_is_named(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    day = one_archived_day(ops, database_url, 3, DELETE_FIRST)
    # The export states the day as it now is, and its own digest agrees with the rows.
    assert run_command(["history", "export", "--day", day, "--out", str(tmp_path)]) == 0
    [(export_id,)] = execute_admin(
        database_url, "SELECT id FROM history_checkpoints WHERE kind = 'exported'"
    )

    code, report = verify(capsys, "--days")

    assert code == 1
    [found] = report["days"]
    assert found["digest_compared_with"] == export_id
    assert any(
        f"export checkpoint #{export_id} states other counts" in problem
        for problem in found["problems"]
    )
    assert not any("is not checkpoint" in problem for problem in found["problems"])


def test_a_partition_dropped_without_its_checkpoint_is_missing(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    day = one_archived_day(ops, database_url, 2)
    partition = "history_p" + day.replace("-", "")
    execute_admin(database_url, f"DROP TABLE {partition}")

    code, report = verify(capsys, "--days")
    _, text = verify_text(capsys, "--days")

    assert code == 1
    [found] = report["days"]
    assert (found["settled_on"], found["verdict"], found["operations"]) == (day, "missing", None)
    assert "no drop was recorded: 2 operation(s)" in found["problems"][0]
    assert f"day {day}: MISSING" in text


def test_a_day_whose_drop_was_recorded_but_not_done_is_not_compared(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    day = one_archived_day(ops, database_url, 2)
    execute_admin(database_url, "SELECT * FROM outbox_history_checkpoint(%s, 'dropped')", (day,))

    code, report = verify(capsys, "--days")
    _, text = verify_text(capsys, "--days")

    assert code == 0
    assert [(d["settled_on"], d["verdict"]) for d in report["days"]] == [(day, "not_compared")]
    assert f"day {day}: not compared, a drop was recorded" in text


def test_one_day_only_and_never_both_selectors(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = two_archived_days(ops, database_url, 1, 1)

    code, report = verify(capsys, "--day", second)
    chain_only_code, chain_only = verify(capsys)
    with pytest.raises(SystemExit) as both:
        run_command(["history", "verify", "--days", "--day", first])
    with pytest.raises(SystemExit) as not_a_day:
        run_command(["history", "verify", "--day", "yesterday"])

    assert (code, chain_only_code) == (0, 0)
    assert [d["settled_on"] for d in report["days"]] == [second]
    assert "days" not in chain_only
    assert (both.value.code, not_a_day.value.code) == (2, 2)
    assert "not a day like 2026-09-01" in capsys.readouterr().err


def test_rows_put_in_a_day_no_archive_recorded_show(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    day = one_archived_day(ops, database_url, 1)
    execute_admin(
        database_url,
        "SELECT outbox_history_partition(DATE '2001-02-03');"
        "INSERT INTO history SELECT DATE '2001-02-03', gen_random_uuid(), run_id, decision_key, "
        "state, settled_at, archived_at, operation, events, callbacks, approvals, "
        "agent_reports, event_count, last_hash FROM history",
    )

    code, report = verify(capsys, "--days")

    assert code == 1
    assert [(d["settled_on"], d["verdict"]) for d in report["days"]] == [
        ("2001-02-03", "mismatch"),
        (day, "matches"),
    ]
    assert report["days"][0]["problems"] == [
        "it holds 1 operation(s) and 3 event(s); its archived checkpoints recorded 0 and 0"
    ]
