"""Noticing that a daemon's database moved to another server.

A deployment that fails Postgres over (RDS Multi-AZ, Patroni, CloudNativePG) either
moves one address to the new primary or names both servers in a libpq multi-host URL
(``postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write``), where libpq
picks the writable one at each connect. Either way a daemon just reconnects; what an
operator needs is to hear that it happened, once per move, by place (``host:port``),
never by URL: a URL may carry a password.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.errors import is_read_only


def server_address(connection: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    """``host:port`` of the server this connection reached (the host as the URL named
    it, or the socket directory for a local socket)."""
    info = connection.info
    return f"{info.host}:{info.port}"


class ServerTracker:
    """Remembers the server a daemon's last new connection reached, and calls
    ``on_move(from_address, to_address)`` when a new one reaches another. The first
    connection is no move."""

    def __init__(self, on_move: Callable[[str, str], None]) -> None:
        self._on_move = on_move
        self.address: str | None = None

    def observe(self, connection: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
        self.seen(server_address(connection))

    def seen(self, address: str) -> None:
        previous, self.address = self.address, address
        if previous is not None and previous != address:
            self._on_move(previous, address)


def follow_failovers(engine: AsyncEngine, tracker: ServerTracker | None = None) -> None:
    """Make a SQLAlchemy engine behave as :class:`~outbox.connections.SessionPool` does
    across a failover: a write refused as read-only counts as a lost connection (so the
    pool drops it and its idle siblings, and the next checkout lets libpq find the
    writable host), and ``tracker`` sees each new connection's server."""

    def read_only_is_a_disconnect(context: ExceptionContext) -> None:
        if is_read_only(context.original_exception):
            context.is_disconnect = True
            context.invalidate_pool_on_disconnect = True

    event.listen(engine.sync_engine, "handle_error", read_only_is_a_disconnect)
    if tracker is not None:

        def observe(dbapi_connection: Any, _record: Any) -> None:
            driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
            if isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
                tracker.observe(driver)

        event.listen(engine.sync_engine, "connect", observe)
