"""``outbox history status`` at a cost that does not grow with the history: each day's
operations and events are the sums of its archived checkpoints (a batch's rows and its
checkpoint commit together), not a count of its partition; a day whose drop was
recorded but which is still attached is counted from its rows (issue #48)."""

from __future__ import annotations

import json
from datetime import date
from typing import Any
from uuid import UUID

import psycopg
import pytest

from outbox import OperationState, Registry
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.sql import QUERIES
from outbox.store import Store

from support.db_helpers import execute_admin
from support.ops_helpers import Ops

S = OperationState


def _settled_ago(database_url: str, days: dict[int, list[UUID]]) -> None:
    # The owner's way to age a terminal row (the transition trigger refuses it
    # otherwise), its message marked published, so the archive takes it.
    with psycopg.connect(database_url) as connection:
        connection.execute("SET LOCAL session_replication_role = replica")
        for ago, ids in days.items():
            connection.execute(
                "UPDATE operations SET updated_at = now() - make_interval(days => %(ago)s) "
                "WHERE id = ANY(%(ids)s)",
                {"ago": ago, "ids": ids},
            )
            connection.execute(
                "UPDATE outbox SET published_at = now() WHERE operation_id = ANY(%(ids)s)",
                {"ids": ids},
            )


def _status(capsys: pytest.CaptureFixture[str], *json_flag: str) -> Any:
    capsys.readouterr()
    assert run_command(["history", "status", *json_flag]) == 0
    out = capsys.readouterr().out
    return json.loads(out) if json_flag else out


def _in_history(database_url: str) -> dict[str, tuple[int, int]]:
    rows = execute_admin(
        database_url,
        "SELECT settled_on::text, count(*), sum(event_count) FROM history GROUP BY 1",
    )
    return {day: (int(operations), int(events)) for day, operations, events in rows}


def _shown(status: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {
        d["settled_on"]: (d["operations"], d["events"]) for d in status["days"] if d["operations"]
    }


@pytest.fixture
def ops(database_url: str, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Ops:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    return Ops(database_url, registry)


def test_status_sums_each_days_checkpoints_and_reads_no_partition(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = [ops.at(S.COMMITTED) for _ in range(3)] + [ops.at(S.REJECTED) for _ in range(2)]
    _settled_ago(database_url, {40: [o.id for o in moved[:3]], 41: [o.id for o in moved[3:]]})
    # Batches of two: a day's operations arrive in several checkpoints.
    assert run_command(["history", "archive", "--hot", "1d", "--batch", "2"]) == 0
    with psycopg.connect(database_url) as connection:
        plan = "\n".join(
            str(row[0])
            for row in connection.execute("EXPLAIN ANALYZE " + QUERIES["history_days"].sql)
        )

    status = _status(capsys, "--json")
    text = _status(capsys)

    assert len(_in_history(database_url)) == 2
    assert _shown(status) == _in_history(database_url)
    assert {d["counted_from"] for d in status["days"]} == {"checkpoints"}
    assert "history_checkpoints_day" in plan, plan
    assert " on history_p" not in plan, plan  # no partition is read, nor planned
    assert "5 operation(s)" in text
    assert "as the archive's checkpoints recorded each day" in text
    assert "counted:" not in text


def test_a_day_whose_drop_was_recorded_and_is_still_attached_is_counted(
    ops: Ops, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The drop's checkpoint is written before the detach: a drop that stopped there
    # leaves the day attached with its rows; so does a straggler archived after a drop.
    first = [ops.at(S.COMMITTED) for _ in range(2)]
    _settled_ago(database_url, {40: [o.id for o in first]})
    assert run_command(["history", "archive", "--hot", "1d"]) == 0
    [day] = _in_history(database_url)
    with psycopg.connect(database_url, autocommit=True) as owner:
        Store(owner, require_transaction=False).run(
            outbox_store.checkpoint_day(date.fromisoformat(day), "dropped")
        )
    straggler = ops.at(S.COMMITTED)
    _settled_ago(database_url, {40: [straggler.id]})
    assert run_command(["history", "archive", "--hot", "1d"]) == 0

    status = _status(capsys, "--json")
    text = _status(capsys)

    assert _shown(status) == _in_history(database_url)
    assert _shown(status)[day][0] == 3
    assert [d["counted_from"] for d in status["days"] if d["settled_on"] == day] == ["rows"]
    assert "(counted: a drop of this day was recorded" in text
