"""The console's server: :class:`outbox.serving.AppServer` on the console's address."""

from __future__ import annotations

from starlette.types import ASGIApp

from outbox.console.config import DEFAULT_HOST, DEFAULT_PORT
from outbox.serving import AppServer


class ConsoleServer(AppServer):
    def __init__(self, app: ASGIApp, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
        super().__init__(app, host, port, name="outbox-console")
