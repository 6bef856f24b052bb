"""Serving an ASGI app (the console, the callbacks receiver) with uvicorn on a socket
bound before it starts, so the address (port 0 included) is known, and printed, before
the first request can arrive."""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import Literal

import uvicorn
from starlette.types import ASGIApp


class AppServer:
    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        *,
        name: str,
        lifespan: Literal["on", "off"] = "off",
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        # Listening from here on: a connection that comes as soon as the address is
        # printed waits in the backlog for uvicorn instead of being refused.
        self._socket.listen(128)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                # Query strings name runs and tools, paths name providers; each app logs
                # its own actions, as data.
                access_log=False,
                server_header=False,
                # The client address must be the TCP peer: a trusted-proxy identity is
                # accepted by that address, so no header may rewrite it.
                proxy_headers=False,
                lifespan=lifespan,
            )
        )
        self.name = name
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve(self) -> None:
        """Serve until SIGINT or SIGTERM (uvicorn's handlers, in the main thread)."""
        self._server.run(sockets=[self._socket])

    def start(self) -> AppServer:
        """Serve on a thread of its own (tests, screenshots); ready when this returns."""
        ready = threading.Event()
        original = self._server.startup

        async def startup(sockets: list[socket.socket] | None = None) -> None:
            await original(sockets=sockets)
            ready.set()

        self._server.startup = startup  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self.serve, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout=20):
            raise RuntimeError(f"{self.name} did not start within 20 s")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
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
