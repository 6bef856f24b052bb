"""The console's operation page shows one page of a timeline, whatever its length, with
links that walk the rest (issue #46: one operation page was 85 MB at 20,000 events); and
the dead letters read each operation's reason without its timeline."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from outbox import Settings
from outbox import store as outbox_store
from outbox.console.app import Console
from outbox.states import EventName

from support.console_cases import link, timeline_rows
from support.console_helpers import client, dead_letter_one, envelope_of, logged_in
from support.ops_helpers import Ops

LONG = 2000


@pytest.fixture
def no_whole_timelines(monkeypatch: pytest.MonkeyPatch) -> None:
    def whole(operation_id: object) -> object:
        raise AssertionError("a console page read a whole timeline")

    monkeypatch.setattr(outbox_store, "events", whole)


def test_the_operation_page_shows_the_newest_page_and_links_walk_it_once(
    browser: TestClient, ops: Ops, no_whole_timelines: None
) -> None:
    operation = ops.new()
    every = ops.lengthen(operation.id, LONG)
    logged_in(browser)

    newest = browser.get(f"/operations/{operation.display_id}").text
    forward: list[int] = []
    path = link(newest, "oldest-events")
    while path is not None:
        html = browser.get(path).text
        assert len(timeline_rows(html)) <= 100
        forward += timeline_rows(html)
        path = link(html, "later-events")
    backward = timeline_rows(newest)
    path = link(newest, "earlier-events")
    while path is not None:
        html = browser.get(path).text
        backward = timeline_rows(html) + backward
        path = link(html, "earlier-events")

    assert timeline_rows(newest) == every[-100:]
    assert f"events {LONG - 98}-{LONG + 1} of {LONG + 1}" in newest
    assert link(newest, "later-events") is None
    assert forward == every
    assert backward == every


@pytest.mark.parametrize(
    ("query", "refusal"),
    [
        ("after=abc", "after: not an event id"),
        ("after=-1", "after: not an event id"),
        ("before=1e9", "before: not an event id"),
        ("after=99999999999999999999", "after: not an event id"),
        ("after=", "after: not an event id"),
        ("after=1&before=9", "starts after one event or ends before one"),
    ],
)
def test_a_bad_timeline_cursor_is_a_400_that_says_why(
    browser: TestClient, ops: Ops, query: str, refusal: str
) -> None:
    operation = ops.new()

    answer = logged_in(browser).get(f"/operations/{operation.display_id}?{query}")

    assert answer.status_code == 400
    assert refusal in answer.text


async def test_dead_letters_read_the_newest_reason_without_the_timeline(
    app_console: Console, settings: Settings, ops: Ops, no_whole_timelines: None
) -> None:
    # Each reason lies under a long timeline: the page reads the newest alone.
    twice = ops.new()
    ops.run(outbox_store.append_event(twice, EventName.DEAD_LETTERED, {"reason": "unknown_tool"}))
    ops.lengthen(twice.id, LONG)
    ops.run(outbox_store.append_event(twice, EventName.DEAD_LETTERED, {"reason": "no_consumer"}))
    ops.lengthen(twice.id, LONG)
    escalated = ops.escalated_at_claim("undeliverable")
    ops.lengthen(escalated.id, LONG)
    await dead_letter_one(settings, envelope_of(twice), message_id="outbox-1")
    await dead_letter_one(settings, envelope_of(escalated), message_id="outbox-2")

    with client(app_console) as test_client:
        page = logged_in(test_client).get("/dead-letters").text

    cells = {
        message_id: page.split(f'<td class="mono">{message_id}</td>')[1].split("</tr>")[0]
        for message_id in ("outbox-1", "outbox-2")
    }
    assert '<td class="why">no_consumer' in cells["outbox-1"]
    assert "escalated" not in cells["outbox-1"]
    assert "its operation is escalated (undeliverable, " in cells["outbox-2"]
