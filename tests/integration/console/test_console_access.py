"""Who the console lets in: logins, sessions, CSRF, the trusted proxy, host names and
the security headers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from httpx import ASGITransport
from starlette.routing import Route
from starlette.testclient import TestClient

from outbox.console.app import MAX_BODY_BYTES, SECURITY_HEADERS, Console, create_app
from outbox.console.config import LOOPBACK_HOSTS
from outbox.console.security import COOKIE, LoginThrottle, Sessions
from outbox.models import Operation

from support.console_cases import S, counts
from support.console_helpers import (
    OPERATOR,
    OTHER,
    OTHER_TOKEN,
    TOKEN,
    client,
    csrf,
    csrf_of,
    logged_in,
    proxy_auth,
)
from support.ops_helpers import Ops


def state_changing_paths(op: Operation) -> list[str]:
    return [
        f"/operations/{op.display_id}/resolve",
        f"/operations/{op.display_id}/approval",
        "/escalations/batch",
        "/dead-letters/requeue",
        "/dead-letters/discard",
        "/logout",
    ]


# --- authentication ---------------------------------------------------------------------


PAGES = ["/", "/operations", "/escalations", "/approvals", "/dead-letters"]
# Pages that need a filter in their query string to show anything.
FILTERED = ["/escalations/batch?run_id=run"]


def test_every_page_sends_a_stranger_to_the_login_page(browser: TestClient, ops: Ops) -> None:
    op = ops.at(S.ESCALATED)

    for path in [*PAGES, *FILTERED, f"/operations/{op.display_id}"]:
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
        "/dead-letters/discard": {"malformed": "yes", "bodies": "0" * 64, "reason": "r"},
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
