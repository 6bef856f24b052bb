"""The console's operation page of an operation that moved to history: read from there,
saying it is archived and since when, its timeline a page at a time and its chain
checked; and every action on it refused, saying why, with nothing changed."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from outbox import store as outbox_store

from support.console_cases import S, link, resolve, timeline_rows
from support.console_helpers import OPERATOR, csrf, logged_in
from support.db_helpers import execute_admin
from support.history_helpers import approved, archive_all, settled_days_ago
from support.ops_helpers import Ops


def history_rows(database_url: str) -> list[tuple[Any, ...]]:
    return execute_admin(database_url, "SELECT * FROM history ORDER BY operation_id")


def test_the_page_of_an_archived_operation_reads_history_and_walks_its_timeline(
    browser: TestClient, ops: Ops, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    operation = approved(ops)
    ops.lengthen(operation.id, 150)
    committed = ops.move(ops.move(ops.get(operation.id), S.IN_FLIGHT), S.COMMITTED)
    every = [event.id for event in ops.events(committed.id)]
    settled_days_ago(database_url, committed.id, 3)
    archive_all(ops)

    def no_hot_timeline(*args: object, **kwargs: object) -> object:
        raise AssertionError("an archived operation's page read the hot timeline")

    monkeypatch.setattr(outbox_store, "events_page", no_hot_timeline)
    logged_in(browser)
    page = browser.get(f"/operations/{committed.display_id[:11]}")
    newest = page.text
    forward: list[int] = []
    path = link(newest, "oldest-events")
    while path is not None:
        html = browser.get(path).text
        forward += timeline_rows(html)
        path = link(html, "later-events")

    assert page.status_code == 200
    assert 'id="archived"' in newest
    assert "moved to history" in newest
    assert 'id="state">committed<' in newest
    assert "re_found" in newest
    assert "lead@example.com" in newest
    assert "(when it settled)" in newest
    assert f"intact, {len(every)} events" in newest
    assert "&#34;amount_cents&#34;: 90000" in newest or '"amount_cents": 90000' in newest
    assert timeline_rows(newest) == every[-100:]
    assert forward == every
    assert 'id="resolve"' not in newest
    assert 'id="decide"' not in newest


def test_a_hot_operation_page_says_nothing_of_history(browser: TestClient, ops: Ops) -> None:
    operation = ops.at(S.COMMITTED)

    html = logged_in(browser).get(f"/operations/{operation.display_id}").text

    assert 'id="archived"' not in html


def test_every_action_on_an_archived_operation_is_refused_saying_so(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    escalated = ops.at(S.ESCALATED)
    # Settled by a person, then moved: the page a person had open still posts.
    settled = ops.rejected_in_store(escalated, evidence="dup", by=OPERATOR)
    settled_days_ago(database_url, settled.id, 3)
    archive_all(ops)
    logged_in(browser)
    before = history_rows(database_url)

    resolved = resolve(browser, settled, resolution="rejected", reason="again")
    token = csrf(browser, "/approvals")
    decided = browser.post(
        f"/operations/{settled.display_id[:11]}/approval",
        data={
            "csrf_token": token,
            "decision": "grant",
            "fingerprint": settled.input_fingerprint,
            "ttl": "1h",
        },
    )

    for answer in (resolved, decided):
        assert answer.status_code == 409, answer.text
        assert f"{settled.display_id} is archived" in answer.text
        assert "nothing was changed" in answer.text
    assert history_rows(database_url) == before
    assert execute_admin(database_url, "SELECT count(*) FROM operations") == [(0,)]
    assert execute_admin(database_url, "SELECT count(*) FROM approvals") == [(0,)]
