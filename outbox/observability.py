"""A small HTTP endpoint for each daemon: ``/metrics`` for Prometheus, ``/healthz``
for orchestrators. Plain asyncio, so it lives on the daemon's own event loop and a
wedged loop shows up as a failing health check."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from outbox.errors import ConfigurationError
from outbox.logs import log_fields

logger = logging.getLogger(__name__)

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


def _response(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


@contextlib.asynccontextmanager
async def serve_http(
    host: str, port: int, registry: CollectorRegistry, healthy: Callable[[], bool]
) -> AsyncIterator[int]:
    """Serve until the block exits; yields the bound port (useful with port 0)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            method, path, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = path.split("?", 1)[0]
            if method != "GET":
                writer.write(_response(405, b"GET only\n"))
            elif path == "/metrics":
                writer.write(_response(200, generate_latest(registry), CONTENT_TYPE_LATEST))
            elif path == "/healthz":
                ok = healthy()
                writer.write(_response(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n"))
            else:
                writer.write(_response(404, b"try /metrics or /healthz\n"))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    try:
        server = await asyncio.start_server(handle, host, port)
    except OSError as error:
        # Most often a second daemon of the same kind on this host, on the default port.
        cause = "the port is in use" if error.errno == errno.EADDRINUSE else error.strerror
        raise ConfigurationError(
            f"cannot serve /metrics and /healthz on {host}:{port}: {cause or type(error).__name__}"
            "; pass --metrics-port 0 (OUTBOX_METRICS_PORT=0) to pick a free port, or another "
            "port or --metrics-host"
        ) from None
    bound = server.sockets[0].getsockname()[1]
    log_fields(logger, logging.INFO, "http.listening", "serving /metrics and /healthz", port=bound)
    try:
        yield int(bound)
    finally:
        server.close()
        await server.wait_closed()
