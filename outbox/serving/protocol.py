"""The connection side of the serving layer: uvicorn's h11 protocol with a head deadline
and a connection cap, the two bounds uvicorn does not have.

uvicorn only times out a kept-alive connection that sends nothing, and restarts that
timer on every byte; a client that sends a request head one byte at a time, or never
finishes it, is held forever (issue #46: 1,100 such connections stayed open). Its
``limit_concurrency`` answers 503 only once a head has arrived, which such a client
never sends. So:

- a timer per connection runs whenever no request of it is being served (from the
  accept, and again after each response): it closes the connection unless a complete
  head arrived first. Bytes do not restart it, so a head sent slowly counts whole.
- a connection accepted past the cap is answered 503 and closed before a byte of it is
  read.

This relies on uvicorn's ``H11Protocol`` (``connections``, ``cycle``, ``transport``,
``loop``, ``data_received``, ``on_response_complete``, ``connection_lost``): pinned in
pyproject, and ``tests/unit/test_serving_protocol.py`` fails if one of them goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from outbox.logs import log_fields
from outbox.serving import Limits

logger = logging.getLogger(__name__)

OVER_CAPACITY = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: 18\r\n"
    b"connection: close\r\n"
    b"\r\n"
    b"too many requests\n"
)

# A flood past the cap is said once per this many seconds, not once per connection.
_OVER_CAPACITY_LOG_SECONDS = 10.0


class BoundedProtocol(H11Protocol):
    """One connection: closed if its head does not arrive in time, refused past the
    cap. Made per server by :func:`protocol_for`, which sets ``limits``."""

    limits: ClassVar[Limits]
    server_name: ClassVar[str]
    _over_capacity_said: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse()
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            # A pipelined request may have started in super(): it is served, not awaited.
            self._await_head(restart=True)
            self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _follow(self) -> None:
        if self._serving():
            self._stop_waiting()

    def _await_head(self, *, restart: bool = False) -> None:
        if restart:
            self._stop_waiting()
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_seconds, self._head_late)

    def _stop_waiting(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self._serving():
            self.transport.close()

    def _refuse(self) -> None:
        self.transport.write(OVER_CAPACITY)
        self.transport.close()
        now = time.monotonic()
        cls = type(self)
        if now - cls._over_capacity_said >= _OVER_CAPACITY_LOG_SECONDS:
            cls._over_capacity_said = now
            log_fields(
                logger,
                logging.WARNING,
                "serving.over_capacity",
                "refusing connections past the cap (said at most once every 10 s)",
                server=self.server_name,
                connections=self.limits.max_connections,
            )


def protocol_for(limits: Limits, name: str) -> type[BoundedProtocol]:
    """A protocol class for one server: uvicorn makes one instance per connection and
    takes a class, so the limits ride on it."""
    return type("BoundedProtocol", (BoundedProtocol,), {"limits": limits, "server_name": name})
