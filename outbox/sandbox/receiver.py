"""A callbacks receiver in the demo's own process: :func:`outbox.callbacks.record_callback`
behind a standard-library HTTP server, one route per provider, as a web app of one's own
would mount it. ``outbox callbacks serve`` is the production one (Starlette, uvicorn,
metrics); this needs nothing beyond the core install, so ``outbox demo`` runs on the
README's first command."""

from __future__ import annotations

import json
import logging
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, cast

import psycopg

from outbox.callbacks import REFUSED_STATUS, CallbackReceiver, record_callback
from outbox.errors import CallbackRefused, DatabaseError
from outbox.logs import log_fields

logger = logging.getLogger("outbox.sandbox.receiver")
SERVE_POLL_SECONDS = 0.02
REQUEST_READ_TIMEOUT = 5.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, receiver: CallbackReceiver, database_url: str) -> None:
        self.receiver = receiver
        self.database_url = database_url
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # No FQDN lookup (it can hang for seconds without DNS), as the sandbox does.
        socketserver.TCPServer.server_bind(self)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log_fields(
            logger,
            logging.WARNING,
            "receiver.handler_error",
            "a callback request failed",
            error=type(sys.exc_info()[1]).__name__,
        )


class _Handler(BaseHTTPRequestHandler):
    timeout = REQUEST_READ_TIMEOUT

    def do_POST(self) -> None:
        server = cast(_Server, self.server)
        provider = self.path.removeprefix("/callbacks/")
        if not self.path.startswith("/callbacks/") or provider not in server.receiver.providers:
            self._answer(404, {"error": "no_such_route"})
            return
        declared = self.headers.get("Content-Length", "")
        if not declared.isdigit() or int(declared) > server.receiver.max_body:
            self._answer(413, {"error": "too_large"})
            return
        body = self.rfile.read(int(declared))
        headers = {name.lower(): value for name, value in self.headers.items()}
        try:
            with psycopg.connect(server.database_url, autocommit=True) as connection:
                received = record_callback(connection, server.receiver, provider, body, headers)
        except CallbackRefused as refused:
            self._answer(REFUSED_STATUS[refused.reason], {"error": refused.reason})
            return
        except (DatabaseError, psycopg.Error):
            self._answer(503, {"error": "unavailable"})
            return
        self._answer(200, {"result": received.result})

    def log_message(self, format: str, *args: Any) -> None:
        return  # the request line names paths; the demo tells its own story

    def _answer(self, status: int, body: dict[str, str]) -> None:
        payload = json.dumps(body).encode()
        self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class LocalReceiver:
    """``POST /callbacks/<provider>`` on a loopback port, recorded into ``database_url``."""

    def __init__(self, receiver: CallbackReceiver, database_url: str, host: str = "127.0.0.1"):
        self._server = _Server(host, 0, receiver, database_url)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> LocalReceiver:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": SERVE_POLL_SECONDS},
            name="demo-callbacks",
            daemon=True,
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
