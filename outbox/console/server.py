"""The console's server: :class:`outbox.serving.server.AppServer` on the console's
address, with the console's body limit (its largest form) unless told otherwise."""

from __future__ import annotations

from starlette.types import ASGIApp

from outbox.console.app import MAX_BODY_BYTES
from outbox.console.config import DEFAULT_HOST, DEFAULT_PORT
from outbox.serving import Limits
from outbox.serving.server import AppServer


class ConsoleServer(AppServer):
    def __init__(
        self,
        app: ASGIApp,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        limits: Limits | None = None,
    ) -> None:
        if limits is None:
            limits = Limits.defaults(max_body=MAX_BODY_BYTES)
        super().__init__(app, host, port, name="outbox-console", limits=limits)
