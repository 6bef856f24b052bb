"""Serving an ASGI app (the console, the callbacks receiver, MCP over HTTP) with uvicorn
on a socket bound before it starts, so the address (port 0 included) is known, and
printed, before the first request can arrive, and a port that is taken is refused in one
line that names it. Every server gets the limits of :class:`outbox.serving.Limits` and
stops on SIGTERM or SIGINT as the daemons do: it stops accepting, gives the requests in
hand the grace, and returns (exit 0); a second signal exits at once."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Literal

import uvicorn

from outbox.cli import run_async
from outbox.errors import ConfigurationError, ServiceUnavailable
from outbox.serving import Limits
from outbox.serving.body import ASGIApp, BodyLimits, Refused
from outbox.serving.protocol import protocol_for
from outbox.signals import run_until_signalled


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Signals are handled by run_until_signalled (AppServer.serve_async): uvicorn's
        # own handling re-raises the signal after shutdown, and the process then dies of
        # it (status -15) instead of exiting 0 with its resources closed.
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or a ConfigurationError that names it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        # Listening from here on: a connection that comes as soon as the address is
        # printed waits in the backlog for uvicorn instead of being refused.
        listener.listen(128)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise ServiceUnavailable(
                f"port {port} on {host} is already in use: stop what listens there, or give "
                "another --port (0 for any free one)"
            ) from None
        raise ConfigurationError(
            f"cannot listen on {host} port {port}: {error.strerror or error} (check --host)"
        ) from None
    return listener


class AppServer:
    def __init__(
        self,
        app: ASGIApp | Any,
        host: str,
        port: int,
        *,
        name: str,
        limits: Limits,
        lifespan: Literal["on", "off"] = "off",
        refused: Refused | None = None,
    ) -> None:
        self._socket = bind(host, port)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self.name = name
        self.limits = limits
        self._server = _Server(
            uvicorn.Config(
                BodyLimits(
                    app,
                    max_body=limits.max_body,
                    body_seconds=limits.body_seconds,
                    refused=refused,
                ),
                http=protocol_for(limits, name),
                # No front end serves a websocket: an upgrade is not a way around the
                # limits.
                ws="none",
                log_config=None,
                log_level="warning",
                # Query strings name runs and tools, paths name providers; each app logs
                # its own actions, as data.
                access_log=False,
                server_header=False,
                # The client address must be the TCP peer: a trusted-proxy identity and
                # the bearer throttle go by that address, so no header may rewrite it.
                proxy_headers=False,
                lifespan=lifespan,
                timeout_graceful_shutdown=max(1, round(limits.grace_seconds)),
            )
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve(self) -> None:
        """Serve until SIGINT or SIGTERM, in the main thread."""
        run_async(self.serve_async())

    async def serve_async(self) -> None:
        """Serve until SIGINT or SIGTERM on the running loop (which must be the main
        thread's): the first stops accepting and finishes the requests in hand within
        the grace, a second exits at once."""
        await run_until_signalled(
            self.name.removeprefix("outbox-"),
            self._run,
            self._stop,
            finishing="finishing the requests in hand",
        )

    async def _run(self) -> None:
        try:
            await self._server.serve(sockets=[self._socket])
        except SystemExit:
            # uvicorn exits when the app's lifespan fails to start; it logged why.
            if self._server.started:
                raise
        if not self._server.started:
            raise ServiceUnavailable(
                f"{self.name} could not start serving on {self.url} (the log line above says why)"
            )

    def _stop(self) -> None:
        self._server.should_exit = True

    def start(self) -> AppServer:
        """Serve on a thread of its own (tests, screenshots); ready when this returns.
        No signal handling: the thread is stopped by :meth:`stop`."""
        ready = threading.Event()
        original = self._server.startup

        async def startup(sockets: list[socket.socket] | None = None) -> None:
            await original(sockets=sockets)
            ready.set()

        self._server.startup = startup  # type: ignore[method-assign]
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._run(),), name=self.name, daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout=20):
            raise RuntimeError(f"{self.name} did not start within 20 s")
        return self

    def stop(self) -> None:
        self._stop()
        if self._thread is not None:
            self._thread.join(timeout=20)
        self._socket.close()

    def __enter__(self) -> AppServer:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
