"""How `outbox mcp` is reached: stdio, or streamable HTTP behind a bearer-token guard.

Over HTTP, decisions are bound to the caller: the guard names the request's principal,
and :mod:`outbox.mcp_tools` prefixes every run id with it. Without a token the only
principal is whoever can reach a loopback address, so anything else is refused.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, cast

from mcp.server import Server
from starlette.applications import Starlette

from outbox.errors import ServiceUnavailable
from outbox.mcp_server import check_exposure
from outbox.mcp_tools import BEARER_PRINCIPAL, LOOPBACK_PRINCIPAL, PRINCIPAL_SCOPE_KEY, ToolHost
from outbox.signals import run_until_signalled

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BearerGuard:
    """Lets through only requests that carry ``Authorization: Bearer <token>`` (when a
    token is configured) and names their principal for the handlers."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self._token = token.encode() if token else None
        self.principal = BEARER_PRINCIPAL if token else LOOPBACK_PRINCIPAL

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            if not self._authorized(scope):
                if scope["type"] == "http":
                    await _unauthorized(send)
                else:  # a websocket: nothing here serves one, and nothing may pass
                    await send({"type": "websocket.close", "code": 1008})
                return
            scope = {**scope, PRINCIPAL_SCOPE_KEY: self.principal}
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        if self._token is None:
            return True
        values = [
            value for name, value in scope.get("headers", []) if name.lower() == b"authorization"
        ]
        if len(values) != 1:
            return False
        scheme, _, presented = bytes(values[0]).partition(b" ")
        # compare_digest: how long a comparison takes must not tell how much of it matched.
        return scheme.lower() == b"bearer" and hmac.compare_digest(presented.strip(), self._token)


async def _unauthorized(send: Send) -> None:
    body = json.dumps(
        {"error": "invalid_token", "error_description": "Authorization: Bearer <token> required"}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer error="invalid_token"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def http_app(server: Server[ToolHost], *, host: str, bearer_token: str | None) -> ASGIApp:
    """The streamable-HTTP app behind the bearer guard; without a token it serves only a
    loopback address (refused otherwise)."""
    check_exposure(host, bearer_token)
    app: Starlette = server.streamable_http_app(host=host)
    return BearerGuard(cast("ASGIApp", app), bearer_token)


# --- transports ----------------------------------------------------------------------


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


# In-flight calls get this long after SIGTERM; a cut one is retried with its key, safely.
GRACEFUL_SHUTDOWN_SECONDS = 5


async def serve_http(
    server: Server[ToolHost], *, host: str, port: int, bearer_token: str | None
) -> None:
    """Serve streamable HTTP at ``http://host:port/mcp``; SIGTERM or SIGINT stops it
    gracefully (exit 0), a second one at once."""
    import uvicorn

    class HTTPServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Signals are handled as the daemons handle them (run_until_signalled below):
            # uvicorn's own handling would re-raise the signal after shutdown and end the
            # process before the database and watcher are closed.
            yield

    app = http_app(server, host=host, bearer_token=bearer_token)
    http_server = HTTPServer(
        # The lifespan (database, watcher, sessions) is entered here, not by uvicorn: a
        # database that cannot be reached then fails the command in one line, before
        # anything listens. No access log: request lines would only repeat the path.
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
    )

    def stop() -> None:
        http_server.should_exit = True

    try:
        async with server.session_manager.run():
            try:
                await run_until_signalled(
                    "mcp", http_server.serve, stop, finishing="finishing the calls in hand"
                )
            except SystemExit:
                # uvicorn exits the process when it cannot bind; it has logged why.
                if http_server.started:
                    raise
            if not http_server.started:
                raise ServiceUnavailable(
                    f"the MCP HTTP server could not listen on {host}:{port} (the log line "
                    "above says why)"
                )
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
