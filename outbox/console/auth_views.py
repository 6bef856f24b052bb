"""Logging in with an operator token, and out."""

from __future__ import annotations

import logging

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.console.app import (
    HTTPProblem,
    action,
    console_of,
    problem_page,
    read_form,
    render,
    set_session_cookie,
)
from outbox.console.security import COOKIE, CSRF_FIELD, check_csrf, credential_for
from outbox.logs import log_fields

log = logging.getLogger("outbox.console")


async def login_page(request: Request) -> Response:
    console = console_of(request)
    session = request.state.session
    if session is not None and session.operator is not None:
        return RedirectResponse("/", status_code=303)
    # An anonymous session exists only so the login form has a CSRF token to check.
    created = session is None
    if created:
        session = console.sessions.new(None)
        request.state.session = session
    response = render(request, "login.html", token_login=bool(console.auth.credentials), error=None)
    if created:
        set_session_cookie(response, session, secure=console.secure_cookie)
    return response


async def login(request: Request) -> Response:
    console = console_of(request)
    session = request.state.session
    try:
        form = await read_form(request)
    except HTTPProblem as problem:
        return problem_page(request, problem)
    if not check_csrf(session, form.get(CSRF_FIELD)):
        return problem_page(
            request,
            HTTPProblem(
                403, "the login form's CSRF token is missing or stale: reload the login page"
            ),
        )
    address = request.client.host if request.client else "unknown"
    if console.throttle.blocked(address):
        # Refused before the token is compared: a right guess now looks like a wrong one.
        log_fields(
            log, logging.WARNING, "console.login_throttled", "console logins are being refused"
        )
        return problem_page(
            request,
            HTTPProblem(
                429,
                "too many refused logins from this address: wait ten minutes and try again",
            ),
        )
    token = form.get("token")
    credential = credential_for(console.auth, token) if isinstance(token, str) else None
    if credential is None:
        console.throttle.failed(address)
        # Neither the token nor how close it came is logged.
        log_fields(log, logging.WARNING, "console.login_refused", "a console login was refused")
        return render(
            request,
            "login.html",
            status=401,
            token_login=bool(console.auth.credentials),
            error="that token is not an operator's token",
        )
    # A fresh session id at login: one planted before it (session fixation) is worthless.
    console.sessions.end(session.id)
    authenticated = console.sessions.new(credential.name)
    response = RedirectResponse("/", status_code=303)
    set_session_cookie(response, authenticated, secure=console.secure_cookie)
    return response


async def _logout(request: Request, form: FormData, operator: str) -> Response:
    console = console_of(request)
    console.sessions.end(request.cookies.get(COOKIE))
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


logout = action(_logout)
