"""What an operator does in the console: resolutions, retries, approvals, and the notice
each leaves.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from outbox import Registry, Settings
from outbox import store as outbox_store
from outbox.cli import run_command
from outbox.models import Operation

from support.console_cases import S, counts, resolve
from support.console_helpers import OPERATOR, client, console, console_settings, csrf, logged_in
from support.db_helpers import execute_admin
from support.ops_helpers import Ops


def approval_rows(database_url: str) -> list[dict[str, Any]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        cursor = connection.execute(
            "SELECT operation_id, decision, approved_by, intent_hash FROM approvals"
        )
        names = [c.name for c in cursor.description or []]
        return [dict(zip(names, row, strict=True)) for row in cursor]


def test_resolving_as_committed_records_the_operator_and_the_reference(
    browser: TestClient, ops: Ops
) -> None:
    op = ops.at(S.ESCALATED)
    logged_in(browser)

    answer = resolve(
        browser,
        op,
        resolution="committed",
        provider_reference="re_42",
        reason="found in the provider dashboard",
        # A name in the form is not an identity: the session's is recorded.
        by="mallory@example.com",
    )

    assert answer.status_code == 303
    settled = ops.get(op.id)
    assert settled.state is S.COMMITTED
    assert settled.provider_reference == "re_42"
    event = ops.events(op.id)[-1]
    assert event.name == "operation.resolved"
    assert event.attributes["by"] == OPERATOR
    assert event.attributes["evidence"] == "found in the provider dashboard"
    assert event.attributes["decision"] == "committed"


def test_a_retry_queues_the_operation_again(browser: TestClient, ops: Ops) -> None:
    op = ops.at(S.ESCALATED)
    logged_in(browser)

    answer = resolve(
        browser, op, resolution="not_committed", reason="provider says nothing arrived"
    )

    assert answer.status_code == 303
    assert ops.get(op.id).state is S.PREPARED
    assert ops.events(op.id)[-1].attributes["decision"] == "not_committed"


def test_a_retry_is_refused_where_the_contract_is_unknown(
    settings: Settings, operator_url: str, ops: Ops, database_url: str
) -> None:
    blind = console(console_settings(settings, operator_url), registry=None)
    op = ops.at(S.ESCALATED)
    with client(blind) as test_client:
        logged_in(test_client)
        page = test_client.get(f"/operations/{op.display_id}").text
        before = counts(database_url)
        answer = resolve(test_client, op, resolution="not_committed", reason="try again")

    assert 'value="not_committed" id="resolution-not_committed" required disabled' in page
    assert answer.status_code == 409
    assert "cannot tell whether a retry is safe" in answer.text
    assert counts(database_url) == before


@pytest.mark.parametrize(
    ("form", "status", "says"),
    [
        ({"resolution": "committed", "reason": "seen"}, 400, "reference of the effect"),
        ({"resolution": "rejected", "reason": "  "}, 400, "the evidence is empty"),
        ({"resolution": "rejected", "reason": "x" * 501}, 400, "at most 500"),
        ({"resolution": "rejected", "reason": "no", "provider_reference": "re_1"}, 400, "only"),
        (
            {"resolution": "refunded", "reason": "no"},
            400,
            "choose one of committed, not_committed, rejected",
        ),
    ],
)
def test_a_bad_resolution_form_changes_nothing(
    browser: TestClient,
    ops: Ops,
    database_url: str,
    form: dict[str, str],
    status: int,
    says: str,
) -> None:
    op = ops.at(S.ESCALATED)
    logged_in(browser)
    before = counts(database_url)

    answer = resolve(browser, op, **form)

    assert answer.status_code == status
    assert says in answer.text
    assert counts(database_url) == before


def test_only_an_escalated_operation_is_resolved(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    committed = ops.at(S.COMMITTED)
    unknown = ops.at(S.OUTCOME_UNKNOWN)
    logged_in(browser)
    before = counts(database_url)

    for op in (committed, unknown):
        answer = resolve(browser, op, resolution="rejected", reason="no")
        assert answer.status_code == 409
        assert "nothing was changed" in answer.text
    assert counts(database_url) == before


def test_an_unknown_operation_is_a_404(browser: TestClient, database_url: str) -> None:
    logged_in(browser)
    token = csrf(browser)
    before = counts(database_url)

    for op_id in ["op_00000000-0000-0000-0000-000000000000", "op_not-a-uuid"]:
        assert browser.get(f"/operations/{op_id}").status_code == 404
        answer = browser.post(
            f"/operations/{op_id}/resolve",
            data={"csrf_token": token, "resolution": "rejected", "reason": "no"},
        )
        assert answer.status_code == 404
    assert counts(database_url) == before


def test_a_resolution_fenced_by_a_concurrent_move_changes_nothing(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    op = ops.at(S.ESCALATED)
    logged_in(browser)
    token = csrf(browser, f"/operations/{op.display_id}")
    # Someone else (the CLI, another console) settles it while this page is open.
    ops.run(
        outbox_store.resolve_operation(
            op.id,
            source=S.ESCALATED,
            target=S.REJECTED,
            decision="rejected",
            resolved_by="cli",
            evidence="first",
        )
    )
    before = counts(database_url)

    answer = browser.post(
        f"/operations/{op.display_id}/resolve",
        data={
            "csrf_token": token,
            "resolution": "committed",
            "provider_reference": "re_9",
            "reason": "late",
        },
    )

    assert answer.status_code == 409
    assert counts(database_url) == before
    assert ops.get(op.id).state is S.REJECTED


# --- approvals --------------------------------------------------------------------------------


def decide(browser: TestClient, op: Operation, **form: str) -> Any:
    token = csrf(browser, "/approvals")
    return browser.post(f"/operations/{op.display_id}/approval", data={"csrf_token": token, **form})


def test_the_approvals_page_shows_the_exact_intent_and_fingerprint(
    browser: TestClient, ops: Ops
) -> None:
    waiting = ops.new(amount_cents=90_000)

    html = logged_in(browser).get("/approvals").text

    assert waiting.display_id in html
    assert waiting.input_fingerprint in html
    assert "&#34;amount_cents&#34;: 90000" in html or '"amount_cents": 90000' in html


def test_a_grant_binds_the_fingerprint_shown_and_the_operator(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    waiting = ops.new(amount_cents=90_000)
    logged_in(browser)

    answer = decide(
        browser,
        waiting,
        decision="grant",
        fingerprint=waiting.input_fingerprint,
        ttl="1h",
        # Names in the form are not an identity: the session's is recorded.
        approved_by="mallory@example.com",
        operator="mallory@example.com",
    )

    assert answer.status_code == 303
    [row] = approval_rows(database_url)
    assert row["decision"] == "granted"
    assert row["approved_by"] == OPERATOR
    assert row["intent_hash"] == waiting.input_fingerprint
    assert "operation.approval_granted" in ops.event_names(waiting.id)


def test_a_grant_for_an_intent_not_shown_is_refused(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    waiting = ops.new(amount_cents=90_000)
    other = ops.new(amount_cents=80_000)
    logged_in(browser)
    before = counts(database_url)

    answer = decide(
        browser, waiting, decision="grant", fingerprint=other.input_fingerprint, ttl="15m"
    )

    assert answer.status_code == 409
    assert "the intent changed since it was shown" in answer.text
    assert counts(database_url) == before


@pytest.mark.parametrize(
    ("form", "says"),
    [
        ({"decision": "grant", "ttl": "15m"}, "fingerprint"),
        ({"decision": "grant", "fingerprint": "ab" * 32, "ttl": "forever"}, "how long"),
        ({"decision": "maybe", "fingerprint": "ab" * 32}, "grant or deny"),
    ],
)
def test_a_bad_approval_form_changes_nothing(
    browser: TestClient, ops: Ops, database_url: str, form: dict[str, str], says: str
) -> None:
    waiting = ops.new(amount_cents=90_000)
    logged_in(browser)
    before = counts(database_url)

    answer = decide(browser, waiting, **form)

    assert answer.status_code == 400
    assert says in answer.text
    assert counts(database_url) == before


def test_a_denial_is_recorded_with_the_operator(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    waiting = ops.new(amount_cents=90_000)
    logged_in(browser)

    answer = decide(browser, waiting, decision="deny", fingerprint=waiting.input_fingerprint)

    assert answer.status_code == 303
    [row] = approval_rows(database_url)
    assert (row["decision"], row["approved_by"]) == ("denied", OPERATOR)


def test_a_settled_operation_cannot_be_approved(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    done = ops.at(S.COMMITTED)
    logged_in(browser)
    before = counts(database_url)

    answer = decide(browser, done, decision="grant", fingerprint=done.input_fingerprint, ttl="15m")

    assert answer.status_code == 409
    assert counts(database_url) == before


def test_a_reason_with_control_characters_changes_nothing(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    op = ops.at(S.ESCALATED)
    logged_in(browser)
    before = counts(database_url)

    for reason in ("no\x00", "no \x1b[31mred"):
        answer = resolve(browser, op, resolution="rejected", reason=reason)
        assert answer.status_code == 400
        assert "control characters" in answer.text
    assert counts(database_url) == before
    # Lines and tabs are a person's writing.
    assert resolve(browser, op, resolution="rejected", reason="line one\r\n\tline two").is_redirect


# --- one rule for both front ends: the console and `outbox ops resolve` agree -------------


def attempted_long_ago(database_url: str, op: Operation, hours: int) -> None:
    """The first attempt moved back in time, as if the escalation had waited that long."""
    execute_admin(
        database_url,
        "UPDATE operations SET first_attempt_at = now() - make_interval(hours => %s) WHERE id = %s",
        (hours, op.id),
    )


RESOLUTION_CASES = {
    # name: (tool, escalated after an attempt made this many hours ago (None: never
    # attempted), the tools both front ends load, the resolution asked for, offered?)
    "a retry inside the dedupe window": ("send_refund", 1, True, "not_committed", True),
    "a retry past the dedupe window": ("send_refund", 25, True, "not_committed", False),
    "a retry of a dedupe write, no tools": ("send_refund", 1, False, "not_committed", False),
    "a retry of a non-repeatable write, no tools": ("open_ticket", 1, False, "not_committed", True),
    "committed, never attempted": ("send_refund", None, True, "committed", False),
    "committed after an attempt": ("send_refund", 1, True, "committed", True),
}


@pytest.mark.parametrize("case", sorted(RESOLUTION_CASES))
def test_the_console_and_ops_resolve_give_the_same_answer(
    case: str,
    settings: Settings,
    operator_url: str,
    registry: Registry,
    ops: Ops,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tool, hours, tools, resolution, offered = RESOLUTION_CASES[case]
    if hours is None:
        op = ops.move(ops.new(tool=tool), S.ESCALATED)
    else:
        op = ops.at(S.ESCALATED, tool=tool)
        attempted_long_ago(database_url, op, hours)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    if tools:
        monkeypatch.setenv("OUTBOX_TOOLS", "support.sample_tools")
    else:
        monkeypatch.delenv("OUTBOX_TOOLS", raising=False)
    web = console(console_settings(settings, operator_url), registry=registry if tools else None)
    with client(web) as test_client:
        logged_in(test_client)
        page = test_client.get(f"/operations/{op.display_id}").text
        choice = re.search(
            rf'value="{resolution}" id="resolution-{resolution}" required( disabled)?', page
        )
        assert choice is not None
        console_offers = choice.group(1) is None
        before = counts(database_url)
        posted = resolve(
            test_client,
            op,
            resolution=resolution,
            reason="checked with the provider",
            **({"provider_reference": "re_9"} if resolution == "committed" else {}),
        )
        console_changed = counts(database_url) != before
    # The same operation again, through the CLI (the console's post changed nothing if it
    # refused; if it accepted, the CLI meets an operation no longer escalated).
    if console_offers:
        op = ops.at(S.ESCALATED, tool=tool)
        attempted_long_ago(database_url, op, hours or 0)
    flags = ["--provider-ref", "re_9"] if resolution == "committed" else []
    code = run_command(
        [
            "ops", "resolve", op.display_id, "--" + resolution.replace("_", "-"), *flags,
            "--evidence", "checked with the provider", "--by", "ana",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err

    assert console_offers is offered
    assert (code == 0) is offered, err
    assert (posted.status_code == 303) is offered
    assert console_changed is offered
    if not offered:
        # The same sentence, from the one rule.
        refused = err.split(" is not offered: ", 1)[1].split(";")[0]
        assert refused in posted.text.replace("&#39;", "'")


def notice_of(html: str) -> str | None:
    found = re.search(r'<p class="notice" id="notice" role="status">([^<]*)</p>', html)
    return found.group(1) if found else None


def test_each_decision_is_confirmed_once_in_the_words_of_the_cli(
    browser: TestClient, ops: Ops
) -> None:
    waiting = ops.new(amount_cents=90_000)
    stuck = ops.at(S.ESCALATED)
    logged_in(browser)
    short = ops.short(waiting.input_fingerprint)

    granted = decide(
        browser, waiting, decision="grant", fingerprint=waiting.input_fingerprint, ttl="1h"
    )
    grant_page = browser.get(granted.headers["location"]).text
    denied = decide(browser, waiting, decision="deny", fingerprint=waiting.input_fingerprint)
    deny_page = browser.get(denied.headers["location"]).text
    resolved = resolve(browser, stuck, resolution="rejected", reason="a duplicate")
    resolve_page = browser.get(resolved.headers["location"]).text

    grant_notice, deny_notice = notice_of(grant_page), notice_of(deny_page)
    assert grant_notice is not None
    assert f"granted by {OPERATOR} for {waiting.display_id} (intent {short}), expires" in (
        grant_notice
    )
    assert deny_notice == (
        f"approval {ops.run(outbox_store.check_approval(waiting.id)).approval.id}: denied by "
        f"{OPERATOR} for {waiting.display_id} (intent {short})"
    )
    assert notice_of(resolve_page) == (
        f"{stuck.display_id}: escalated -&gt; rejected: it will not be attempted again"
    )
    # Once: a reload does not confirm it again.
    assert notice_of(browser.get(resolved.headers["location"]).text) is None
