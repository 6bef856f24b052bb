"""An operation's timeline is read a page at a time, never whole: by the store, by
`outbox ops show` (text and JSON). Daemons may append any number of events to one
operation (issue #46: one operation page was 85 MB at 20,000 events), so each reader
gets at most one bounded page, and its cursors walk the timeline exactly once, in order.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import psycopg
import pytest

from outbox import Registry
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.sql import QUERIES
from outbox.store import EventsPage, Store

from support.db_helpers import index_plan
from support.logs import statements_seen
from support.ops_helpers import Ops

# As long as a long provider outage makes a timeline; the birth event comes first.
LONG = 5000


@pytest.fixture
def ops(database_url: str, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Ops:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    return Ops(database_url, registry)


@pytest.fixture
def no_whole_timelines(monkeypatch: pytest.MonkeyPatch) -> None:
    def whole(operation_id: object) -> object:
        raise AssertionError("a front end read a whole timeline")

    monkeypatch.setattr(outbox_store, "events", whole)


def page(ops: Ops, operation_id: UUID, **cursor: Any) -> EventsPage:
    with psycopg.connect(ops.database_url) as connection:
        return Store(connection).run(outbox_store.events_page(operation_id, **cursor))


def test_pages_walk_a_timeline_once_in_order_from_either_end(ops: Ops) -> None:
    operation = ops.new()
    every = ops.lengthen(operation.id, 1234)

    forward: list[int] = []
    after: int | None = 0
    while after is not None:
        shown = page(ops, operation.id, after_id=after, limit=outbox_store.MAX_EVENTS_PAGE)
        assert len(shown.events) <= outbox_store.MAX_EVENTS_PAGE
        assert shown.earlier == len(forward)
        assert shown.total == len(every)
        forward += [event.id for event in shown.events]
        after = shown.next
    backward: list[int] = []
    newest = page(ops, operation.id, limit=300)
    assert [e.id for e in newest.events] == every[-300:]
    assert (newest.earlier, newest.later, newest.next) == (len(every) - 300, 0, None)
    before: int | None = newest.previous
    backward = [event.id for event in newest.events]
    while before is not None:
        shown = page(ops, operation.id, before_id=before, limit=300)
        assert shown.later == len(backward)
        backward = [event.id for event in shown.events] + backward
        before = shown.previous

    assert forward == every
    assert backward == every


def test_a_page_past_either_end_is_empty_and_points_back(ops: Ops) -> None:
    operation = ops.new()
    every = ops.lengthen(operation.id, 9)

    past = page(ops, operation.id, after_id=every[-1])
    before_first = page(ops, operation.id, before_id=every[0])

    assert (past.events, past.earlier, past.later, past.next) == ([], 10, 0, None)
    assert [e.id for e in page(ops, operation.id, before_id=past.previous).events] == every
    assert (before_first.events, before_first.earlier, before_first.later) == ([], 0, 10)
    assert before_first.previous is None


@pytest.mark.parametrize(
    ("cursor", "refusal"),
    [
        ({"limit": outbox_store.MAX_EVENTS_PAGE + 1}, "holds 1 to 500 events"),
        ({"limit": 0}, "holds 1 to 500 events"),
        ({"after_id": 1, "before_id": 9}, "not both"),
        ({"after_id": -1}, "not an event id"),
        ({"before_id": 1 << 63}, "not an event id"),
    ],
)
def test_the_store_refuses_an_unbounded_or_malformed_page(
    ops: Ops, cursor: dict[str, int], refusal: str
) -> None:
    operation = ops.new()

    with pytest.raises(ValueError, match=refusal):
        page(ops, operation.id, **cursor)


def shown(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = run_command(["ops", "show", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_ops_show_prints_the_newest_page_and_says_how_to_reach_the_rest(
    ops: Ops, capsys: pytest.CaptureFixture[str], no_whole_timelines: None
) -> None:
    operation = ops.new()
    every = ops.lengthen(operation.id, LONG)

    document = json.loads(shown(capsys, operation.display_id, "--json"))
    text = shown(capsys, operation.display_id)

    assert [event["id"] for event in document["events"]] == every[-100:]
    assert document["events_total"] == LONG + 1
    assert (document["next"], document["previous"]) == (None, every[-100])
    assert f"timeline (events {LONG - 98}-{LONG + 1} of {LONG + 1})" in text
    assert text.count("agent.completed") == 100
    assert (
        f"{LONG - 99} earlier event(s): outbox ops show {operation.display_id} "
        f"--before {every[-100]}" in text
    )


def test_ops_show_cursors_walk_the_whole_timeline_once_in_order(
    ops: Ops, capsys: pytest.CaptureFixture[str], no_whole_timelines: None
) -> None:
    operation = ops.new()
    every = ops.lengthen(operation.id, LONG)

    walked: list[int] = []
    flags = ["--after", "0"]
    while True:
        document = json.loads(
            shown(capsys, operation.display_id, "--json", "--events", "500", *flags)
        )
        assert len(document["events"]) <= 500
        walked += [event["id"] for event in document["events"]]
        if document["next"] is None:
            break
        flags = ["--after", str(document["next"])]
    middle = shown(capsys, operation.display_id, "--events", "7", "--after", str(every[99]))

    assert walked == every
    assert f"timeline (events 101-107 of {LONG + 1})" in middle
    assert f"--after {every[106]}" in middle
    assert f"--before {every[100]}" in middle


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--after", "abc"], "not an event id"),
        (["--after", "-1"], "not an event id"),
        (["--before", "99999999999999999999"], "not an event id"),
        (["--events", "0"], "must be between 1 and 500"),
        (["--events", "501"], "must be between 1 and 500"),
        (["--after", "1", "--before", "9"], "not allowed with argument"),
    ],
)
def test_ops_show_refuses_a_bad_cursor_or_page_size_by_name(
    ops: Ops, capsys: pytest.CaptureFixture[str], flags: list[str], refusal: str
) -> None:
    operation = ops.new()

    with pytest.raises(SystemExit) as exit_info:
        run_command(["ops", "show", operation.display_id, *flags])

    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert refusal in err


def test_what_show_and_verify_hold_is_a_page_whatever_the_timeline(
    ops: Ops, capsys: pytest.CaptureFixture[str]
) -> None:
    # Counted, not timed: every statement's rows are what the command holds at once.
    # ops verify recomputes each chain in the database and gets one row per operation.
    operation = ops.new()
    ops.lengthen(operation.id, LONG)

    with statements_seen() as seen:
        shown(capsys, operation.display_id, "--json")
        shown(capsys, operation.display_id, "--events", "500", "--after", "0")
        assert run_command(["ops", "verify", operation.display_id]) == 0
        assert run_command(["ops", "verify", "--all"]) == 0

    held = seen.rows()
    assert ("list_events_page", 100) in held
    assert ("list_events_page", 500) in held
    assert [rows for query, rows in held if query == "verify_event_chains"] == [1, 1]
    assert max(rows for _, rows in held) <= outbox_store.MAX_EVENTS_PAGE


@pytest.mark.parametrize("forward", [True, False])
def test_a_page_is_read_from_the_timeline_index(database_url: str, forward: bool) -> None:
    cursor = {"forward": forward, "after": 0, "before": 1 << 40, "limit": 100}
    plan = index_plan(
        database_url, QUERIES["list_events_page"].sql, {"operation_id": UUID(int=1), **cursor}
    )

    # The page's rows come off the index in order; the one sort left is of those rows.
    scan = "Index Scan" if forward else "Index Scan Backward"
    assert f"{scan} using operation_events_operation on operation_events " in plan, plan
    assert "Seq Scan on operation_events" not in plan, plan
