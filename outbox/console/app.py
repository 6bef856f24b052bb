"""The console's ASGI application: routes, authentication, security headers, rendering.

Pages are rendered on the server by Jinja2 with autoescaping on, and the Content
Security Policy allows no script at all: whatever an agent, a provider or a person put
in an input, a run id or a reference is shown as text, and could not run even if a
template forgot to escape it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from html import escape
from typing import Any

import psycopg
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.datastructures import FormData, Headers
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from outbox.console.config import HOSTS_ENV, LOOPBACK_HOSTS, AuthConfig
from outbox.console.security import (
    COOKIE,
    CSRF_FIELD,
    LoginThrottle,
    Session,
    Sessions,
    check_csrf,
    identity_header,
)
from outbox.console.security import proxy_operator as trusted_proxy_operator
from outbox.contracts import Registry
from outbox.errors import (
    ConfigurationError,
    DatabaseError,
    IllegalTransition,
    InputRefused,
    OperationNotFound,
    OutboxError,
    ServiceUnavailable,
)
from outbox.serving.body import read_body, replay
from outbox.settings import Settings
from outbox.text import printable

SECURITY_HEADERS = {
    # No script, no frames, no form posts elsewhere; styles and images from here only.
    "content-security-policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    # Pages show inputs and names: no shared cache, no back-button copy after logout.
    "cache-control": "no-store",
}
# Paths a visitor reaches before logging in.
_OPEN_PATHS = ("/login", "/static/")
# Form limits: the console's forms have a handful of short fields and no files.
MAX_FORM_FIELDS = 20
# The largest request body read: the biggest form is a 500-character reason. The login
# form is open to anyone who can reach the port, so without a bound one request could
# make the process buffer as much as it is sent. `outbox console` serves it as the
# serving layer's body limit too (outbox/serving), which refuses first there; Guard's
# own check holds wherever the app is served otherwise.
MAX_BODY_BYTES = 64 * 1024


@dataclass
class Console:
    """Everything a request handler needs: the deployment's settings, who may log in,
    the tools whose contract cards are shown, and the live sessions."""

    settings: Settings
    auth: AuthConfig
    registry: Registry | None = None
    secure_cookie: bool = False
    refresh_seconds: int = 15
    sessions: Sessions = field(default_factory=Sessions)
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS
    """The Host names served (lower case, without port); None serves any."""


class HTTPProblem(Exception):
    """A request the console refuses, with the status and the sentence to show."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_templates = Environment(
    loader=PackageLoader("outbox.console", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
# Control characters (terminal escapes, bidi overrides) are shown escaped, as the CLI does.
_templates.filters["shown"] = printable


def _shown_lines(text: str) -> str:
    """Multi-line text of our own making (a contract card): its line breaks kept, every
    other control character escaped."""
    return "\n".join(printable(line) for line in text.splitlines())


_templates.filters["shown_lines"] = _shown_lines


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def session_of(request: Request) -> Session:
    session: Session = request.state.session
    return session


def render(request: Request, template: str, *, status: int = 200, **context: Any) -> HTMLResponse:
    session: Session | None = getattr(request.state, "session", None)
    console = console_of(request)
    # Shown once: the page after an action confirms it, a reload does not repeat it.
    notice = session.notice if session else None
    if session is not None:
        session.notice = None
    html = _templates.get_template(template).render(
        notice=notice,
        operator=session.operator if session else None,
        csrf_field=CSRF_FIELD,
        csrf_token=session.csrf if session else "",
        path=request.url.path,
        refresh_seconds=console.refresh_seconds,
        **context,
    )
    return HTMLResponse(html, status_code=status)


def problem_page(request: Request, problem: HTTPProblem) -> HTMLResponse:
    return render(request, "error.html", status=problem.status, message=problem.message)


class Authentication(BaseHTTPMiddleware):
    """Attach the request's session; send anyone unauthenticated to the login page."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        console = console_of(request)
        session = console.sessions.get(request.cookies.get(COOKIE))
        new_session: Session | None = None
        proxy = console.auth.proxy
        if proxy is not None:
            named = trusted_proxy_operator(
                console.auth,
                request.client.host if request.client else None,
                identity_header(request.headers.raw, proxy.header),
            )
            if named is not None and (session is None or session.operator != named):
                # The proxy's word is the identity: a session of anyone else is dropped.
                new_session = session = console.sessions.new(named, via_proxy=True)
            elif named is None and session is not None and session.via_proxy:
                # A proxy session used without the proxy (another route in) is void.
                session = None
        request.state.session = session
        authenticated = session is not None and session.operator is not None
        if not authenticated and not request.url.path.startswith(_OPEN_PATHS):
            if request.method in ("GET", "HEAD"):
                response: Response = RedirectResponse("/login", status_code=303)
            else:
                response = problem_page(
                    request,
                    HTTPProblem(401, "not logged in: log in and try again; nothing was changed"),
                )
        else:
            response = await call_next(request)
        if new_session is not None:
            set_session_cookie(response, new_session, secure=console.secure_cookie)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response


def _bare_page(status: int, message: str) -> Response:
    """A refusal made before (or without) the templates and the session: the request's
    own values are never echoed, and the headers are those of every page."""
    body = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Refused</title>'
        f'</head><body><p id="problem">{escape(message)}</p></body></html>'
    )
    return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)


def host_name(value: str) -> str:
    """The name of a Host header value, without its port, in lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class Guard:
    """Checks made before any session or form is looked at: the Host is one this console
    serves, and the body is not larger than any of its forms."""

    def __init__(self, app: ASGIApp, console: Console) -> None:
        self.app = app
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        allowed = self.console.allowed_hosts
        hosts = headers.getlist("host")
        if allowed is not None and (len(hosts) != 1 or host_name(hosts[0]) not in allowed):
            refusal = _bare_page(
                421,
                "this console does not serve that host name; an operator who reaches it "
                f"through another name lists that name in {HOSTS_ENV}",
            )
            await refusal(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
            await _too_large(scope, receive, send)
            return
        body = await read_body(receive, MAX_BODY_BYTES)
        if body is None:
            return  # the client went away
        if len(body) > MAX_BODY_BYTES:
            await _too_large(scope, receive, send)
            return
        await self.app(scope, replay(body, receive), send)


async def _too_large(scope: Scope, receive: Receive, send: Send) -> None:
    refusal = _bare_page(
        413,
        f"the request is larger than any form here ({MAX_BODY_BYTES} bytes); nothing was changed",
    )
    await refusal(scope, receive, send)


async def server_error(request: Request, error: Exception) -> Response:
    """An unexpected failure: a page that says so, with every page's headers, and no
    trace, SQL or value of the request on it (the traceback goes to the server's log)."""
    return _bare_page(
        500,
        "the console failed on this request (its log says why); look at the operation's "
        "page before you try again",
    )


def set_session_cookie(response: Response, session: Session, *, secure: bool) -> None:
    response.set_cookie(
        COOKIE,
        session.id,
        httponly=True,
        samesite="strict",
        secure=secure,
        path="/",
    )


Handler = Callable[[Request], Awaitable[Response]]
ActionHandler = Callable[[Request, FormData, str], Awaitable[Response]]


def refusal(error: Exception) -> HTTPProblem:
    """The status and sentence for what the runtime refused; a driver's own text is not
    shown (it can quote connection parameters)."""
    if isinstance(error, HTTPProblem):
        return error
    if isinstance(error, InputRefused):
        return HTTPProblem(400, f"{error}; nothing was changed")
    if isinstance(error, OperationNotFound):
        return HTTPProblem(404, str(error))
    if isinstance(error, IllegalTransition):
        return HTTPProblem(409, str(error))
    if isinstance(error, ServiceUnavailable | DatabaseError):
        return HTTPProblem(503, f"{error}; nothing was changed")
    if isinstance(error, ConfigurationError):
        return HTTPProblem(400, str(error))
    if isinstance(error, psycopg.Error):
        state = f" (SQLSTATE {error.sqlstate})" if error.sqlstate else ""
        return HTTPProblem(503, f"the database refused or failed{state}; nothing was changed")
    return HTTPProblem(409, f"{error}; nothing was changed")


_REFUSED = (HTTPProblem, OutboxError, psycopg.Error)


def page(handler: Handler) -> Handler:
    """A GET page: a refusal becomes an error page with its status."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except _REFUSED as error:
            return problem_page(request, refusal(error))

    endpoint.__name__ = handler.__name__
    return endpoint


def action(handler: ActionHandler) -> Handler:
    """A state-changing POST: refused unless its form carries the session's CSRF token;
    the operator is the session's, never a form field."""

    async def endpoint(request: Request) -> Response:
        try:
            form = await read_form(request)
            session = session_of(request)
            if not check_csrf(session, form.get(CSRF_FIELD)):
                raise HTTPProblem(
                    403,
                    "this form's CSRF token is missing or does not belong to your session: "
                    "reload the page and submit again; nothing was changed",
                )
            assert session.operator is not None
            return await handler(request, form, session.operator)
        except _REFUSED as error:
            return problem_page(request, refusal(error))

    endpoint.__name__ = handler.__name__
    endpoint.state_changing = True  # type: ignore[attr-defined]
    return endpoint


async def read_form(request: Request) -> FormData:
    try:
        return await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)
    except Exception as error:  # starlette raises its own HTTPException or a parser error
        raise HTTPProblem(400, f"the form could not be read ({type(error).__name__})") from None


def create_app(console: Console) -> Starlette:
    # Imported here: the views import this module for render/page/action.
    from outbox.console import actions, auth_views, batch, pages

    routes = [
        Route("/", pages.overview, methods=["GET"]),
        Route("/operations", pages.operations, methods=["GET"]),
        Route("/operations/{operation_id}", pages.operation, methods=["GET"]),
        Route("/operations/{operation_id}/resolve", actions.resolve, methods=["POST"]),
        Route("/operations/{operation_id}/approval", actions.decide, methods=["POST"]),
        Route("/escalations", pages.escalations, methods=["GET"]),
        Route("/escalations/batch", batch.preview, methods=["GET"]),
        Route("/escalations/batch", batch.resolve, methods=["POST"]),
        Route("/approvals", pages.approvals, methods=["GET"]),
        Route("/dead-letters", pages.dead_letters, methods=["GET"]),
        Route("/dead-letters/requeue", actions.requeue, methods=["POST"]),
        Route("/dead-letters/discard", pages.discard_preview, methods=["GET"]),
        Route("/dead-letters/discard", actions.discard, methods=["POST"]),
        Route("/login", auth_views.login_page, methods=["GET"]),
        Route("/login", auth_views.login, methods=["POST"]),
        Route("/logout", auth_views.logout, methods=["POST"]),
        Mount("/static", StaticFiles(packages=[("outbox.console", "static")]), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(Guard, console=console), Middleware(Authentication)],
        exception_handlers={Exception: server_error},
    )
    app.state.console = console
    return app
