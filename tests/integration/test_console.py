"""``outbox console`` over HTTP, against the real database, as a login that is only an
operator: authentication, CSRF, escaping, and the guarded actions. Each refusal is
checked to have changed nothing."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import psycopg
import pytest
from httpx import ASGITransport
from starlette.routing import Route
from starlette.testclient import TestClient

from outbox import OperationState, Registry, Settings
from outbox import store as outbox_store
from outbox.broker import OperationMessage
from outbox.callback_policy import CallbackReport, CallbackStatus
from outbox.cli import run_command
from outbox.console.app import MAX_BODY_BYTES, SECURITY_HEADERS, Console, create_app
from outbox.console.config import LOOPBACK_HOSTS
from outbox.console.security import COOKIE, LoginThrottle, Sessions
from outbox.errors import ReadOnlyDatabase
from outbox.models import Operation
from outbox.states import EventName
from outbox.store import OperationFilter, Store

from support.broker_helpers import read_raw
from support.console_helpers import (
    CANARY,
    OPERATOR,
    OTHER,
    OTHER_TOKEN,
    TOKEN,
    client,
    console,
    console_settings,
    csrf,
    csrf_of,
    dead_letter_one,
    logged_in,
    operator_login,
    proxy_auth,
)
from support.db_helpers import execute_admin
from support.ops_helpers import Ops

S = OperationState


@pytest.fixture
def operator_url(postgres_server_url: str, database_url: str) -> Iterator[str]:
    with operator_login(postgres_server_url, database_url) as url:
        yield url


@pytest.fixture
def app_console(settings: Settings, operator_url: str, registry: Registry) -> Console:
    return console(console_settings(settings, operator_url), registry=registry)


@pytest.fixture
def browser(app_console: Console) -> Iterator[TestClient]:
    with client(app_console) as test_client:
        yield test_client


@pytest.fixture
def ops(database_url: str, registry: Registry) -> Ops:
    return Ops(database_url, registry)


def counts(database_url: str) -> dict[str, int]:
    """Everything an action could write, as committed."""
    with psycopg.connect(database_url, autocommit=True) as connection:
        row = connection.execute(
            "SELECT (SELECT count(*) FROM operation_events), (SELECT count(*) FROM approvals),"
            " (SELECT count(*) FROM outbox),"
            " (SELECT string_agg(state, ',' ORDER BY id) FROM operations)"
        ).fetchone()
    assert row is not None
    return {"events": row[0], "approvals": row[1], "outbox": row[2], "states": row[3]}


def approval_rows(database_url: str) -> list[dict[str, Any]]:
    with psycopg.connect(database_url, autocommit=True) as connection:
        cursor = connection.execute(
            "SELECT operation_id, decision, approved_by, intent_hash FROM approvals"
        )
        names = [c.name for c in cursor.description or []]
        return [dict(zip(names, row, strict=True)) for row in cursor]


def state_changing_paths(op: Operation) -> list[str]:
    return [
        f"/operations/{op.display_id}/resolve",
        f"/operations/{op.display_id}/approval",
        "/dead-letters/requeue",
        "/logout",
    ]


# --- authentication ---------------------------------------------------------------------


PAGES = ["/", "/operations", "/escalations", "/approvals", "/dead-letters"]


def test_every_page_sends_a_stranger_to_the_login_page(browser: TestClient, ops: Ops) -> None:
    op = ops.at(S.ESCALATED)

    for path in [*PAGES, f"/operations/{op.display_id}"]:
        answer = browser.get(path)
        assert answer.status_code == 303, path
        assert answer.headers["location"] == "/login"


def test_every_action_refuses_a_stranger_and_changes_nothing(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    op = ops.at(S.ESCALATED)
    before = counts(database_url)
    # A stranger holding a login page's CSRF token is still a stranger.
    token = csrf(browser, "/login")

    for path in state_changing_paths(op):
        answer = browser.post(
            path, data={"csrf_token": token, "resolution": "rejected", "reason": "x"}
        )
        assert answer.status_code == 401, path
    assert counts(database_url) == before


def test_a_wrong_token_is_refused_and_not_logged(
    browser: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "not-the-token-" + "z" * 20
    page = browser.get("/login")

    with caplog.at_level(logging.DEBUG):
        answer = browser.post("/login", data={"token": wrong, "csrf_token": csrf_of(page.text)})

    assert answer.status_code == 401
    assert "not an operator" in answer.text
    assert browser.get("/").status_code == 303
    assert wrong not in caplog.text
    assert "console.login_refused" in [getattr(r, "action", None) for r in caplog.records]


def test_guessing_tokens_is_throttled_even_for_a_right_guess(
    app_console: Console, caplog: pytest.LogCaptureFixture
) -> None:
    app_console.throttle = LoginThrottle(limit=3)
    with client(app_console, address="10.0.0.66") as guesser:
        token = csrf(guesser, "/login")
        for n in range(3):
            wrong = guesser.post("/login", data={"token": f"guess-{n:012d}", "csrf_token": token})
            assert wrong.status_code == 401
        with caplog.at_level(logging.WARNING):
            right = guesser.post("/login", data={"token": TOKEN, "csrf_token": token})

        assert right.status_code == 429
        assert guesser.get("/").status_code == 303
        assert TOKEN not in caplog.text
    # Another address is not held back by this one's guesses.
    with client(app_console, address="10.0.0.67") as operator:
        assert logged_in(operator).get("/").status_code == 200


def test_login_without_its_csrf_token_is_refused(browser: TestClient) -> None:
    browser.get("/login")

    answer = browser.post("/login", data={"token": TOKEN})

    assert answer.status_code == 403
    assert browser.get("/").status_code == 303


def test_each_token_logs_in_as_its_own_operator(app_console: Console) -> None:
    with client(app_console) as first, client(app_console) as second:
        assert OPERATOR in logged_in(first).get("/").text
        page = logged_in(second, OTHER_TOKEN).get("/").text
        assert OTHER in page
        assert OPERATOR not in page


def test_login_issues_a_new_session_id(browser: TestClient) -> None:
    browser.get("/login")
    planted = browser.cookies[COOKIE]

    logged_in(browser)

    assert browser.cookies[COOKIE] != planted


def test_the_session_cookie_is_httponly_and_samesite_strict(app_console: Console) -> None:
    with client(app_console) as test_client:
        page = test_client.get("/login")
        answer = test_client.post("/login", data={"token": TOKEN, "csrf_token": csrf_of(page.text)})

    for cookie in (page.headers["set-cookie"].lower(), answer.headers["set-cookie"].lower()):
        assert "httponly" in cookie
        assert "samesite=strict" in cookie


def test_the_session_cookie_is_secure_when_asked(app_console: Console) -> None:
    app_console.secure_cookie = True
    with client(app_console) as test_client:
        cookie = test_client.get("/login").headers["set-cookie"].lower()

    assert "secure" in cookie


def test_logout_ends_the_session(browser: TestClient) -> None:
    logged_in(browser)
    session = browser.cookies[COOKIE]

    assert browser.post("/logout", data={"csrf_token": csrf(browser)}).status_code == 303

    browser.cookies.set(COOKIE, session)
    assert browser.get("/").status_code == 303


def test_pages_forbid_scripts_and_framing(browser: TestClient) -> None:
    answer = logged_in(browser).get("/")

    policy = answer.headers["content-security-policy"]
    assert "default-src 'none'" in policy
    assert "script-src" not in policy  # falls back to default-src 'none': no script at all
    assert "frame-ancestors 'none'" in policy
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["cache-control"] == "no-store"


# --- the trusted proxy --------------------------------------------------------------------


def test_a_trusted_proxy_names_the_operator(app_console: Console, ops: Ops) -> None:
    app_console.auth = proxy_auth("10.0.0.7")
    op = ops.at(S.ESCALATED)
    with client(app_console, address="10.0.0.7") as proxied:
        proxied.headers["X-Forwarded-User"] = "proxy-user@example.com"
        page = proxied.get(f"/operations/{op.display_id}")
        answer = proxied.post(
            f"/operations/{op.display_id}/resolve",
            data={
                "csrf_token": csrf_of(page.text),
                "resolution": "rejected",
                "reason": "customer withdrew",
            },
        )

    assert answer.status_code == 303, answer.text
    resolved = [e for e in ops.events(op.id) if e.name == "operation.resolved"]
    assert resolved[0].attributes["by"] == "proxy-user@example.com"


def test_the_identity_header_is_ignored_from_anywhere_else(app_console: Console) -> None:
    app_console.auth = proxy_auth("10.0.0.7")
    with client(app_console, address="10.0.0.8") as direct:
        direct.headers["X-Forwarded-User"] = "mallory@example.com"
        assert direct.get("/").status_code == 303


def test_a_proxy_session_is_void_without_the_proxy(app_console: Console) -> None:
    app_console.auth = proxy_auth("10.0.0.7")
    with client(app_console, address="10.0.0.7") as proxied:
        proxied.headers["X-Forwarded-User"] = "proxy-user@example.com"
        assert proxied.get("/").status_code == 200
        session = proxied.cookies[COOKIE]
    with client(app_console, address="10.0.0.8") as direct:
        direct.cookies.set(COOKIE, session)
        assert direct.get("/").status_code == 303


# --- CSRF ---------------------------------------------------------------------------------


def test_every_state_changing_route_checks_csrf(app_console: Console) -> None:
    app = create_app(app_console)
    posts = [
        route
        for route in app.routes
        if isinstance(route, Route) and route.methods and "POST" in route.methods
    ]

    assert {route.path for route in posts} >= {"/login", "/logout"}
    for route in posts:
        if route.path != "/login":  # checks its own token, before there is an operator
            assert getattr(route.endpoint, "state_changing", False), route.path


@pytest.mark.parametrize("token", [None, "", "forged-token"])
def test_a_post_without_the_sessions_csrf_token_changes_nothing(
    browser: TestClient, ops: Ops, database_url: str, token: str | None
) -> None:
    logged_in(browser)
    escalated = ops.at(S.ESCALATED)
    waiting = ops.new(amount_cents=90_000)
    before = counts(database_url)
    forms = {
        f"/operations/{escalated.display_id}/resolve": {
            "resolution": "rejected",
            "reason": "no",
        },
        f"/operations/{waiting.display_id}/approval": {
            "decision": "grant",
            "fingerprint": waiting.input_fingerprint,
            "ttl": "15m",
        },
        "/dead-letters/requeue": {"all": "yes"},
        "/logout": {},
    }

    for path, form in forms.items():
        data = form if token is None else {**form, "csrf_token": token}
        answer = browser.post(path, data=data)
        assert answer.status_code == 403, path
        assert "CSRF" in answer.text
    assert counts(database_url) == before
    assert browser.get("/").status_code == 200  # still logged in: logout was refused too


def test_another_sessions_csrf_token_is_refused(
    app_console: Console, ops: Ops, database_url: str
) -> None:
    op = ops.at(S.ESCALATED)
    with client(app_console) as mine, client(app_console) as theirs:
        their_token = csrf(logged_in(theirs, OTHER_TOKEN))
        before = counts(database_url)
        answer = logged_in(mine).post(
            f"/operations/{op.display_id}/resolve",
            data={"csrf_token": their_token, "resolution": "rejected", "reason": "no"},
        )

    assert answer.status_code == 403
    assert counts(database_url) == before


# --- escaping -------------------------------------------------------------------------------


def test_agent_and_provider_text_is_shown_escaped(
    browser: TestClient, database_url: str, registry: Registry
) -> None:
    ops = Ops(database_url, registry, free_text=CANARY)
    waiting = ops.new(amount_cents=90_000, run_id=CANARY)
    escalated = ops.at(S.ESCALATED, run_id=CANARY)
    committed = ops.run(
        outbox_store.resolve_operation(
            escalated.id,
            source=S.ESCALATED,
            target=S.COMMITTED,
            decision="committed",
            resolved_by="setup",
            evidence=CANARY,
            provider_reference=CANARY,
        )
    )
    logged_in(browser)

    for path in [
        "/",
        "/operations",
        f"/operations?run_id={CANARY}",
        "/approvals",
        f"/operations/{waiting.display_id}",
        f"/operations/{committed.display_id}",
    ]:
        html = browser.get(path).text
        assert "<script>" not in html, path
        assert "&lt;script&gt;" in html or path == "/", path


# --- resolving an escalation ----------------------------------------------------------------


def resolve(browser: TestClient, op: Operation, **form: str) -> Any:
    token = csrf(browser, f"/operations/{op.display_id}")
    return browser.post(f"/operations/{op.display_id}/resolve", data={"csrf_token": token, **form})


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
        ({"resolution": "rejected", "reason": "  "}, 400, "reason is required"),
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


# --- listings -------------------------------------------------------------------------------


def test_pages_follow_a_keyset_without_gaps_or_repeats(
    database_url: str, registry: Registry
) -> None:
    ops = Ops(database_url, registry)
    made = {ops.new(amount_cents=100 + n, run_id="paged").id for n in range(7)}
    ops.new(run_id="elsewhere")
    seen: list[Any] = []
    after = None
    with psycopg.connect(database_url) as connection:
        while True:
            page = Store(connection).run(
                outbox_store.operations_page(OperationFilter(run_id="paged"), after=after, limit=3)
            )
            seen += [row.id for row in page.rows]
            if page.next is None:
                break
            after = page.next

    assert len(seen) == 7
    assert set(seen) == made


def test_the_operations_page_filters_and_links_to_the_next_page(
    browser: TestClient, ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.console import pages

    monkeypatch.setattr(pages, "PAGE_SIZE", 2)
    for n in range(3):
        ops.new(amount_cents=100 + n, run_id="listed")
    ops.new(tool="open_ticket", run_id="listed")
    logged_in(browser)

    first = browser.get("/operations?run_id=listed&tool=send_refund&state=prepared")
    assert first.status_code == 200
    assert first.text.count('href="/operations/op_') == 2
    assert "open_ticket" not in first.text.split('id="operations"')[1]
    link = first.text.split('id="next-page" href="')[1].split('"')[0].replace("&amp;", "&")
    second = browser.get(link)
    assert second.text.count('href="/operations/op_') == 1
    assert 'id="next-page"' not in second.text


@pytest.mark.parametrize(
    "query",
    ["state=exploded", "since=yesterday", "after_ts=2026-01-01T00:00:00", "after_id=x&after_ts=1"],
)
def test_a_bad_filter_is_refused_not_ignored(browser: TestClient, query: str) -> None:
    answer = logged_in(browser).get(f"/operations?{query}")

    assert answer.status_code == 400


def test_the_overview_counts_what_waits_for_a_person(browser: TestClient, ops: Ops) -> None:
    escalated = ops.at(S.ESCALATED)
    ops.new(amount_cents=90_000)

    html = logged_in(browser).get("/").text

    assert 'http-equiv="refresh"' in html
    tile = html.split('id="tile-escalations"')[1].split("</a>")[0]
    assert '<span class="big">1</span>' in tile
    tile = html.split('id="tile-approvals"')[1].split("</a>")[0]
    assert '<span class="big">1</span>' in tile
    assert escalated.display_id in html


def test_the_operation_page_shows_timeline_card_and_approvals(
    browser: TestClient, ops: Ops
) -> None:
    op = ops.at(S.ESCALATED)

    html = logged_in(browser).get(f"/operations/{op.display_id}").text

    for name in ops.event_names(op.id):
        assert name in html
    assert "send_refund v1" in html
    assert "Refund part or all of a captured payment" in html  # the contract card
    assert 'id="resolve"' in html


def test_the_operation_page_shows_its_provider_callbacks_escaped(
    browser: TestClient, ops: Ops
) -> None:
    op = ops.at(S.ESCALATED)
    report = CallbackReport(
        event_id="evt_console",
        status=CallbackStatus.COMMITTED,
        operation_id=op.id,
        provider_reference=f"re_{CANARY}",
    )
    receipt = ops.run(outbox_store.record_callback("payments", report, "f" * 64))

    html = logged_in(browser).get(f"/operations/{op.display_id}").text

    timeline = html.split('id="timeline"')[1].split("</table>")[0]
    assert "operation.callback_received" in timeline
    table = html.split('id="callbacks"')[1].split("</table>")[0]
    assert f"<td>{receipt.callback_id}</td>" in table
    assert "evt_console" in table
    assert "not applied yet" in table
    assert CANARY not in html  # a provider's text is escaped, never markup
    assert "re_&lt;script&gt;" in table


# --- the evidence chain ---------------------------------------------------------------------


@pytest.fixture
def chain_console(app_console: Console) -> Iterator[TestClient]:
    with client(app_console) as test_client:
        yield logged_in(test_client)


def chain_text(test_client: TestClient, op: Operation) -> str:
    html = test_client.get(f"/operations/{op.display_id}").text
    return html.split('id="evidence-chain">')[1].split("</dd>")[0]


def test_the_operation_page_shows_an_intact_chain(chain_console: TestClient, ops: Ops) -> None:
    op = ops.at(S.ESCALATED)

    assert f"intact, {len(ops.events(op.id))} events" in chain_text(chain_console, op)


def test_the_operation_page_names_the_altered_event(
    chain_console: TestClient, ops: Ops, database_url: str
) -> None:
    op = ops.at(S.ESCALATED)
    altered = ops.events(op.id)[1]
    with psycopg.connect(database_url) as connection:
        # Past the append-only trigger, as only a superuser can go.
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operation_events SET attributes = '{\"attempt\": 9}' WHERE id = %s",
            (altered.id,),
        )

    shown = chain_text(chain_console, op)

    assert "broken" in shown
    assert f"event {altered.id} (hash_mismatch)" in shown


# --- dead letters -----------------------------------------------------------------------------


async def test_a_dead_letter_is_listed_and_requeued_by_an_operator(
    app_console: Console, settings: Settings, ops: Ops, caplog: pytest.LogCaptureFixture
) -> None:
    op = ops.at(S.ESCALATED)
    envelope = OperationMessage(
        operation_id=op.id,
        outbox_id=7,
        tool="send_refund",
        tool_version=1,
        input_fingerprint=op.input_fingerprint,
    )
    await dead_letter_one(settings, envelope, message_id="outbox-7")

    with client(app_console) as test_client, caplog.at_level(logging.INFO):
        page = logged_in(test_client).get("/dead-letters").text
        assert "outbox-7" in page
        assert op.display_id in page
        token = csrf_of(page)
        missing = test_client.post(
            "/dead-letters/requeue", data={"csrf_token": token, "message_id": "outbox-999"}
        )
        requeued = test_client.post(
            "/dead-letters/requeue", data={"csrf_token": token, "message_id": "outbox-7"}
        )
        after = test_client.get("/dead-letters").text

    assert missing.status_code == 404
    assert requeued.status_code == 303
    assert "the dead-letter queue is empty" in after
    [back] = await read_raw(settings.amqp_url.get_secret_value(), settings.queue, expect=1)
    assert back.message_id == "outbox-7"
    lines = [r for r in caplog.records if getattr(r, "action", None) == "console.dlq_requeue"]
    assert [getattr(r, "operator", None) for r in lines] == [OPERATOR, OPERATOR]
    assert [getattr(r, "requeued", None) for r in lines] == [0, 1]


def envelope_of(op: Operation) -> OperationMessage:
    return OperationMessage(
        operation_id=op.id,
        outbox_id=7,
        tool=op.tool_name,
        tool_version=op.tool_version,
        input_fingerprint=op.input_fingerprint,
    )


async def test_dead_letters_say_why_they_died_and_what_became_of_their_operation(
    app_console: Console, settings: Settings, ops: Ops
) -> None:
    undeliverable = ops.escalated_at_claim("undeliverable")
    no_tool = ops.new()
    ops.run(outbox_store.append_event(no_tool, EventName.DEAD_LETTERED, {"reason": "unknown_tool"}))
    missing = OperationMessage(
        operation_id=uuid.uuid4(),
        outbox_id=9,
        tool="send_refund",
        tool_version=1,
        input_fingerprint="ab" * 32,
    )
    await dead_letter_one(settings, envelope_of(undeliverable), message_id="outbox-1")
    await dead_letter_one(settings, envelope_of(no_tool), message_id="outbox-2")
    await dead_letter_one(settings, missing, message_id="outbox-3")

    with client(app_console) as test_client:
        page = logged_in(test_client).get("/dead-letters").text

    rows = {
        message_id: page.split(f'<td class="mono">{message_id}</td>')[1].split("</tr>")[0]
        for message_id in ("outbox-1", "outbox-2", "outbox-3")
    }
    assert "its operation is escalated (undeliverable, " in rows["outbox-1"]
    assert "a requeued copy would only be acknowledged" in rows["outbox-1"]
    assert "refused by a consumer, 1 time(s)" in rows["outbox-1"]
    assert '<td class="why">unknown_tool' in rows["outbox-2"]
    assert "escalated" not in rows["outbox-2"]
    assert '<td class="why">unknown_operation: no operation has this id' in rows["outbox-3"]
    assert "\u00d7" not in page  # the multiplication sign of "rejected x1"


def test_a_requeue_must_choose_what(browser: TestClient) -> None:
    token = csrf(logged_in(browser))

    for form in ({}, {"all": "yes", "message_id": "outbox-1"}):
        answer = browser.post("/dead-letters/requeue", data={"csrf_token": token, **form})
        assert answer.status_code == 400


# --- hardening: what an attacker on the network, or a careless link, could try ----------


def test_a_flood_of_login_pages_does_not_log_an_operator_out(app_console: Console) -> None:
    # Anyone who reaches the port makes an anonymous session with each GET /login.
    app_console.sessions = Sessions(limit=5, anonymous_limit=5)
    with client(app_console) as operator:
        logged_in(operator)
        with client(app_console) as stranger:
            for _ in range(20):
                stranger.cookies.clear()
                assert stranger.get("/login").status_code == 200

        assert operator.get("/").status_code == 200


def test_an_oversized_body_is_refused_before_it_is_read(
    browser: TestClient, ops: Ops, database_url: str
) -> None:
    op = ops.at(S.ESCALATED)
    page = browser.get("/login")
    huge = "x" * (MAX_BODY_BYTES + 1)

    # The login form is open to strangers: it must not buffer whatever it is sent.
    answer = browser.post("/login", data={"csrf_token": csrf_of(page.text), "token": huge})
    assert answer.status_code == 413
    assert answer.headers["content-security-policy"].startswith("default-src 'none'")

    logged_in(browser)
    token = csrf(browser, f"/operations/{op.display_id}")
    before = counts(database_url)
    answer = browser.post(
        f"/operations/{op.display_id}/resolve",
        data={"csrf_token": token, "resolution": "rejected", "reason": "no", "pad": huge},
    )
    assert answer.status_code == 413
    assert counts(database_url) == before


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8740", "127.0.0.1.evil.example", "localhost.:1"]
)
def test_a_request_for_another_host_name_is_refused(
    app_console: Console, ops: Ops, database_url: str, host: str
) -> None:
    # DNS rebinding: a page of evil.example whose name now points at the console's
    # address sends same-origin requests, and can set any header on them.
    app_console.auth = proxy_auth("127.0.0.1")
    op = ops.at(S.ESCALATED)
    before = counts(database_url)
    with client(app_console) as rebound:
        rebound.headers["host"] = host
        rebound.headers["X-Forwarded-User"] = "mallory@example.com"
        page = rebound.get("/")
        answer = rebound.post(
            f"/operations/{op.display_id}/resolve",
            data={"resolution": "rejected", "reason": "no"},
        )

    assert page.status_code == 421
    assert COOKIE not in page.headers.get("set-cookie", "")
    assert "mallory" not in page.text
    assert answer.status_code == 421
    assert counts(database_url) == before


def test_the_loopback_names_and_listed_names_are_served(app_console: Console) -> None:
    app_console.allowed_hosts = (*LOOPBACK_HOSTS, "console.example.com")
    with client(app_console) as test_client:
        for host in ("127.0.0.1:8740", "localhost", "[::1]:8740", "Console.Example.com"):
            test_client.headers["host"] = host
            assert test_client.get("/login").status_code == 200, host


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Forwarded-User", "mallory@example.com"), ("X-Forwarded-User", "ada@example.com")],
        [("X-Forwarded-User", "mallory@example.com, ada@example.com")],
        [("X_Forwarded_User", "mallory@example.com"), ("X-Forwarded-User", "ada@example.com")],
        [("X_Forwarded_User", "mallory@example.com")],
    ],
)
def test_an_ambiguous_identity_header_names_nobody(
    app_console: Console, headers: list[tuple[str, str]]
) -> None:
    app_console.auth = proxy_auth("10.0.0.7")
    transport = ASGITransport(create_app(app_console), client=("10.0.0.7", 50000))

    async def ask() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            return await http.get("/", headers=httpx.Headers(headers))

    answer = asyncio.run(ask())

    assert answer.status_code == 303
    assert answer.headers["location"] == "/login"


def test_the_identity_header_name_is_case_insensitive(app_console: Console) -> None:
    app_console.auth = proxy_auth("10.0.0.7")
    with client(app_console, address="10.0.0.7") as proxied:
        proxied.headers["x-forwarded-user"] = "proxy-user@example.com"
        assert "proxy-user@example.com" in proxied.get("/").text


def test_logout_by_get_ends_nothing(browser: TestClient) -> None:
    logged_in(browser)

    assert browser.get("/logout").status_code == 405
    assert browser.get("/").status_code == 200


def test_login_goes_only_to_the_overview(browser: TestClient) -> None:
    # No next= is honoured: there is no redirect an attacker could point elsewhere.
    page = browser.get("/login?next=https://evil.example/")
    answer = browser.post(
        "/login?next=https://evil.example/",
        data={"token": TOKEN, "csrf_token": csrf_of(page.text), "next": "//evil.example"},
    )

    assert "evil.example" not in page.text
    assert answer.status_code == 303
    assert answer.headers["location"] == "/"


def test_every_response_carries_the_security_headers(browser: TestClient, ops: Ops) -> None:
    op = ops.at(S.ESCALATED)
    answers = {
        "stranger redirect": browser.get("/"),
        "login page": browser.get("/login"),
    }
    logged_in(browser)
    answers |= {
        "page": browser.get(f"/operations/{op.display_id}"),
        "404 page": browser.get("/operations/op_00000000-0000-0000-0000-000000000000"),
        "unknown path": browser.get("/nowhere"),
        "stylesheet": browser.get("/static/console.css"),
        "csrf refusal": browser.post(f"/operations/{op.display_id}/resolve", data={}),
        "redirect": browser.post(
            "/operations/" + op.display_id + "/resolve",
            data={"csrf_token": csrf(browser), "resolution": "rejected", "reason": "no"},
        ),
    }

    for what, answer in answers.items():
        assert (
            answer.headers["content-security-policy"] == SECURITY_HEADERS["content-security-policy"]
        ), what
        assert answer.headers["x-frame-options"] == "DENY", what
        assert answer.headers["referrer-policy"] == "no-referrer", what
        assert answer.headers["x-content-type-options"] == "nosniff", what
        assert answer.headers["cache-control"] == "no-store", what
    assert answers["redirect"].status_code == 303


def test_an_unexpected_failure_shows_no_trace_or_sql(
    app_console: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.console import pages

    async def broken(request: Any, work: Any) -> Any:
        raise RuntimeError(f"SELECT secret FROM operations WHERE token = '{TOKEN}'")

    with TestClient(
        create_app(app_console),
        base_url="http://127.0.0.1",
        follow_redirects=False,
        raise_server_exceptions=False,
    ) as test_client:
        logged_in(test_client)
        monkeypatch.setattr(pages, "read", broken)
        answer = test_client.get("/")

    assert answer.status_code == 500
    for leak in ("SELECT", "Traceback", "RuntimeError", TOKEN):
        assert leak not in answer.text
    assert answer.headers["content-security-policy"] == SECURITY_HEADERS["content-security-policy"]
    assert answer.headers["cache-control"] == "no-store"


def test_a_page_reads_in_a_read_only_transaction(
    app_console: Console, ops: Ops, database_url: str
) -> None:
    from outbox.console import pages

    op = ops.at(S.ESCALATED)
    write = outbox_store.resolve_operation(
        op.id,
        source=S.ESCALATED,
        target=S.REJECTED,
        decision="rejected",
        resolved_by="a page",
        evidence="pages never write",
    )

    with pytest.raises(ReadOnlyDatabase, match="ReadOnlySqlTransaction"):
        pages._db(app_console.settings, lambda runner: runner.run(write))
    assert ops.get(op.id).state is S.ESCALATED


@pytest.mark.parametrize(
    "query", ["run_id=run%00", "tool=send%1b[2J", f"run_id={'r' * 201}", "tool=send%C2%85refund"]
)
def test_a_filter_with_control_characters_or_too_long_is_a_400(
    browser: TestClient, query: str
) -> None:
    answer = logged_in(browser).get(f"/operations?{query}")

    assert answer.status_code == 400
    assert "control characters" in answer.text


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


def test_filter_values_are_escaped_in_inputs_and_the_next_page_link(
    browser: TestClient, ops: Ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.console import pages

    monkeypatch.setattr(pages, "PAGE_SIZE", 1)
    hostile = "\"'><script>alert(1)</script>&x=1"
    for _ in range(2):
        ops.new(run_id=hostile)
    logged_in(browser)

    html = browser.get("/operations", params={"run_id": hostile}).text

    assert "<script>" not in html
    assert 'value="&#34;&#39;&gt;&lt;script&gt;alert(1)&lt;/script&gt;&amp;x=1"' in html
    link = html.split('id="next-page" href="')[1].split('"')[0].replace("&amp;", "&")
    assert parse_qs(urlsplit(link).query)["run_id"] == [hostile]
    second = browser.get(link)
    assert second.status_code == 200
    assert second.text.count('href="/operations/op_') == 1


def test_pages_with_tied_change_times_have_no_gaps_or_repeats(
    browser: TestClient, ops: Ops, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.console import pages

    monkeypatch.setattr(pages, "PAGE_SIZE", 2)
    made = [ops.new(amount_cents=100 + n, run_id="tied").id for n in range(5)]
    with psycopg.connect(database_url) as connection:
        # One instant for all: past the trigger that stamps updated_at, as a superuser.
        connection.execute("SET LOCAL session_replication_role = replica")
        connection.execute(
            "UPDATE operations SET updated_at = '2026-01-01T00:00:00Z' WHERE run_id = 'tied'"
        )
    logged_in(browser)

    seen: list[str] = []
    path: str | None = "/operations?run_id=tied"
    while path is not None:
        html = browser.get(path).text
        seen += re.findall(r'href="/operations/(op_[^"]+)"', html)
        found = re.search(r'id="next-page" href="([^"]+)"', html)
        path = found.group(1).replace("&amp;", "&") if found else None

    assert seen == [f"op_{i}" for i in sorted(made, reverse=True)]


def test_the_keyset_is_read_from_an_index(database_url: str) -> None:
    with psycopg.connect(database_url) as connection:
        # The planner would rather sort a handful of rows: forbid that, and a scan of the
        # table, to see whether an index can serve the page at all.
        connection.execute("SET LOCAL enable_seqscan = off")
        connection.execute("SET LOCAL enable_sort = off")
        plan = "\n".join(
            row[0]
            for row in connection.execute(
                "EXPLAIN SELECT id FROM operations"
                " WHERE (updated_at, id)"
                " < ('2026-01-01T00:00:00Z', '00000000-0000-0000-0000-000000000000')"
                " ORDER BY updated_at DESC, id DESC LIMIT 51"
            )
        )

    assert "Scan Backward using operations_updated" in plan, plan


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


def test_the_escalations_page_says_why_each_waits_and_for_how_long(
    browser: TestClient, ops: Ops
) -> None:
    tampered = ops.escalated_at_claim("tampered", check="fingerprint_mismatch")
    logged_in(browser)

    html = browser.get("/escalations").text

    row = html.split(f'href="/operations/{tampered.display_id}"')[1].split("</tr>")[0]
    assert '<td class="reason">tampered</td>' in row
    assert re.search(r'<td class="num" title="[^"]+">\d+s</td>', row), row


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
