"""How `outbox mcp` is reached: stdio, or streamable HTTP behind a bearer-token guard.

Over HTTP, decisions are bound to the caller: the guard names the request's principal
(the name its token maps to), and :mod:`outbox.mcp.server` prefixes every run id with it.
Without tokens the only principal is whoever can reach a loopback address, so anything
else is refused. Refused tokens are counted per client address; past the limit, the
address is refused unread (429) for the rest of the window.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, cast

from mcp.server import Server
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE
from starlette.applications import Starlette

from outbox.credentials import Credential, FailureThrottle, credential_for
from outbox.logs import log_fields
from outbox.mcp.config import LOOPBACK_PRINCIPAL, PRINCIPAL_SCOPE_KEY, check_exposure
from outbox.mcp.server import ToolHost
from outbox.serving import Limits

logger = logging.getLogger("outbox.mcp")

# The largest request body read: the SDK's own bound (4 MiB), enforced by the serving
# layer before the SDK reads anything.
MAX_BODY: int = DEFAULT_MAX_REQUEST_BODY_SIZE

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BearerGuard:
    """Lets through only requests that carry ``Authorization: Bearer <token>`` with one
    of ``credentials`` (when any are configured) and names their principal for the
    handlers. ``throttle`` counts refused tokens per client address: the address is the
    TCP peer's, so serve this with no proxy-header rewriting in front (serve_http)."""

    def __init__(
        self, app: ASGIApp, credentials: Sequence[Credential], throttle: FailureThrottle
    ) -> None:
        self.app = app
        self._credentials = tuple(credentials)
        self._throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        principal = LOOPBACK_PRINCIPAL
        if self._credentials:
            address = _client_address(scope)
            wait = self._throttle.retry_after(address)
            if wait:
                # Refused before the token is compared: a right guess now looks like a
                # wrong one. Not logged again: the line that started the hold said so.
                await _refuse(scope, send, 429, retry_after=wait)
                return
            credential = self._credential(scope)
            if credential is None:
                self._refused(address)
                await _refuse(scope, send, 401)
                return
            principal = credential.name
        await self.app({**scope, PRINCIPAL_SCOPE_KEY: principal}, receive, send)

    def _credential(self, scope: Scope) -> Credential | None:
        values = [
            value for name, value in scope.get("headers", []) if name.lower() == b"authorization"
        ]
        if len(values) != 1:
            return None
        scheme, _, presented = bytes(values[0]).partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return credential_for(self._credentials, presented.strip())

    def _refused(self, address: str) -> None:
        failures = self._throttle.failed(address)
        # The address only: neither the token presented nor how close it came.
        log_fields(
            logger,
            logging.WARNING,
            "mcp.unauthorized",
            "refused a request without a valid bearer token",
            address=address,
            failures=failures,
        )
        if self._throttle.blocked(address):
            log_fields(
                logger,
                logging.WARNING,
                "mcp.throttled",
                "refusing every request from an address after its refused bearer tokens",
                address=address,
                seconds=self._throttle.retry_after(address),
            )


def _client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


_REFUSALS = {
    401: (
        {"error": "invalid_token", "error_description": "Authorization: Bearer <token> required"},
        [(b"www-authenticate", b'Bearer error="invalid_token"')],
    ),
    429: (
        {
            "error": "too_many_attempts",
            "error_description": "too many refused bearer tokens from this address: wait for "
            "the seconds Retry-After says",
        },
        [],
    ),
}


async def _refuse(scope: Scope, send: Send, status: int, *, retry_after: int = 0) -> None:
    if scope["type"] != "http":  # a websocket: nothing here serves one, and nothing may pass
        await send({"type": "websocket.close", "code": 1008})
        return
    document, headers = _REFUSALS[status]
    body = json.dumps(document).encode()
    if retry_after:
        headers = [*headers, (b"retry-after", str(retry_after).encode())]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def http_app(
    server: Server[ToolHost],
    *,
    host: str,
    credentials: Sequence[Credential],
    throttle: FailureThrottle | None = None,
) -> ASGIApp:
    """The streamable-HTTP app behind the bearer guard; without credentials it serves
    only a loopback address (refused otherwise)."""
    check_exposure(host, credentials)
    app: Starlette = server.streamable_http_app(host=host)
    return BearerGuard(cast("ASGIApp", app), credentials, throttle or FailureThrottle())


async def serve_stdio(server: Server[ToolHost]) -> None:
    """Serve one client on stdin/stdout until it closes stdin. Logs go to stderr."""
    from mcp.server.stdio import stdio_server

    try:
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())
    except BaseExceptionGroup as group:
        # The transport's task group wraps what failed (the database at startup, say);
        # one failure is reported as itself, in one line, like every command's errors.
        raise _sole_failure(group) from None


async def serve_http(
    server: Server[ToolHost],
    *,
    host: str,
    port: int,
    credentials: Sequence[Credential],
    limits: Limits,
) -> None:
    """Serve streamable HTTP at ``http://host:port/mcp`` through the serving layer;
    SIGTERM or SIGINT stops it gracefully (exit 0), a second one at once."""
    from outbox.serving.server import AppServer

    app = http_app(server, host=host, credentials=credentials)
    # Bound before the lifespan is entered: a port that is taken is refused in one line
    # before the database is touched.
    http_server = AppServer(app, host, port, name="mcp", limits=limits)
    try:
        # The lifespan (database, watcher, sessions) is entered here, not by uvicorn: a
        # database that cannot be reached then fails the command in one line.
        async with server.session_manager.run():
            print(f"outbox mcp: serving on {http_server.url}/mcp", flush=True)
            await http_server.serve_async()
    except BaseExceptionGroup as group:
        raise _sole_failure(group) from None


def _sole_failure(group: BaseExceptionGroup[BaseException]) -> BaseException:
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        error = pending.pop()
        if isinstance(error, BaseExceptionGroup):
            pending.extend(error.exceptions)
        else:
            leaves.append(error)
    return leaves[0] if len(leaves) == 1 else group
