"""The console's batch resolution over HTTP, as an operator-only login: a preview that
changes nothing, a confirmation that resolves exactly what was previewed, and every
refusal leaving the database as it was."""

from __future__ import annotations

import re
from typing import Any

import pytest
from starlette.testclient import TestClient

from support.console_cases import S, counts
from support.console_helpers import OPERATOR, csrf_of, logged_in
from support.ops_helpers import Ops

RUN = "run_fault_4711"
_HIDDEN = re.compile(r'<input type="hidden" name="([a-z_]+)" value="([^"]*)">')


def preview(browser: TestClient, **query: str) -> tuple[str, dict[str, str]]:
    """The preview page and the fields its confirming form would post."""
    page = browser.get("/escalations/batch", params=query)
    assert page.status_code == 200, page.text
    return page.text, dict(_HIDDEN.findall(page.text))


def confirm(browser: TestClient, form: dict[str, str], **extra: str) -> Any:
    return browser.post(
        "/escalations/batch",
        data={**form, "resolution": "rejected", "evidence": "provider fault 4711", **extra},
    )


def test_a_preview_lists_the_selection_and_changes_nothing(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    selected = [ops.escalated_for("lookups_unavailable", run_id=RUN) for _ in range(2)]
    other = ops.escalated_for("tampered", run_id=RUN)
    logged_in(browser)
    before = counts(database_url)

    html, form = preview(browser, run_id=RUN, reason="lookups_unavailable")

    assert "<strong>2</strong> escalated operation(s) match" in html
    assert all(op.display_id[:11] in html for op in selected)
    assert other.display_id[:11] not in html
    assert form["run_id"] == RUN
    assert form["reason"] == "lookups_unavailable"
    assert counts(database_url) == before


def test_confirming_resolves_exactly_the_previewed_operations(
    browser: TestClient, ops: Ops
) -> None:
    selected = [ops.escalated_for("lookups_unavailable", run_id=RUN) for _ in range(3)]
    logged_in(browser)
    _, form = preview(browser, run_id=RUN)

    answer = confirm(browser, form, by="mallory@example.com")

    assert answer.status_code == 200, answer.text
    assert "<strong>3</strong> of 3 resolved as rejected" in answer.text
    batch_ids = set()
    for op in selected:
        assert ops.get(op.id).state is S.REJECTED
        event = ops.events(op.id)[-1]
        assert event.attributes["by"] == OPERATOR  # the session's, never a form field
        assert event.attributes["evidence"] == "provider fault 4711"
        batch_ids.add(event.attributes["batch_id"])
    assert len(batch_ids) == 1
    assert str(batch_ids.pop()) in answer.text


def test_a_selection_that_changed_since_the_preview_is_refused_whole(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    listed = ops.escalated_for("lookups_unavailable", run_id=RUN)
    gone = ops.escalated_for("lookups_unavailable", run_id=RUN)
    logged_in(browser)
    _, form = preview(browser, run_id=RUN)
    # An escalation arriving after the preview is outside its window, and leaves it
    # alone; one of the listed resolved meanwhile changes what the batch would do.
    ops.escalated_for("lookups_unavailable", run_id=RUN)
    ops.rejected_in_store(ops.get(gone.id), evidence="by hand", by="bo")
    before = counts(database_url)

    answer = confirm(browser, form)

    assert answer.status_code == 409
    assert "changed since the preview" in answer.text
    assert counts(database_url) == before
    assert ops.get(listed.id).state is S.ESCALATED


def test_an_escalation_after_the_preview_is_not_resolved(browser: TestClient, ops: Ops) -> None:
    listed = ops.escalated_for("lookups_unavailable", run_id=RUN)
    logged_in(browser)
    _, form = preview(browser, run_id=RUN)
    late = ops.escalated_for("lookups_unavailable", run_id=RUN)

    answer = confirm(browser, form)

    assert answer.status_code == 200, answer.text
    assert ops.get(listed.id).state is S.REJECTED
    assert ops.get(late.id).state is S.ESCALATED


@pytest.mark.parametrize(
    ("change", "status", "says"),
    [
        ({"resolution": "committed"}, 400, "committed needs each operation"),
        ({"evidence": "  "}, 400, "the evidence is empty"),
        ({"selection": ""}, 400, "does not carry the selection"),
        ({"csrf_token": "forged"}, 403, "CSRF token"),
        ({"run_id": "", "selected_at": "2026-01-01T00:00:00+00:00"}, 400, "select the escal"),
    ],
)
def test_a_bad_confirmation_changes_nothing(
    browser: TestClient,
    ops: Ops,
    database_url: str,
    change: dict[str, str],
    status: int,
    says: str,
) -> None:
    ops.escalated_for("lookups_unavailable", run_id=RUN)
    logged_in(browser)
    _, form = preview(browser, run_id=RUN)
    before = counts(database_url)

    answer = confirm(browser, form, **change)

    assert answer.status_code == status, answer.text
    assert says in answer.text
    assert counts(database_url) == before


def test_a_preview_without_a_condition_is_refused(browser: TestClient, ops: Ops) -> None:
    ops.escalated_for("lookups_unavailable", run_id=RUN)
    logged_in(browser)

    answer = browser.get("/escalations/batch")

    assert answer.status_code == 400
    assert "select the escalations by tool, reason, run or escalation time" in answer.text
    assert csrf_of(browser.get("/escalations").text)  # the filter form is on the page
    assert 'action="/escalations/batch"' in browser.get("/escalations").text
