"""Telling a read-only refusal from other errors, and a move to another server from a
reconnect to the same one."""

from __future__ import annotations

import psycopg.errors
import sqlalchemy.exc

from outbox.errors import ReadOnlyDatabase, TransientDatabaseError, is_read_only
from outbox.failover import ServerTracker


def test_a_read_only_refusal_is_known_however_it_is_wrapped() -> None:
    driver = psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE")
    by_store = TransientDatabaseError("claim")
    by_store.driver_error = driver
    by_sqlalchemy = sqlalchemy.exc.OperationalError("UPDATE", {}, driver)

    assert is_read_only(ReadOnlyDatabase())
    assert is_read_only(driver)
    assert is_read_only(by_store)
    assert is_read_only(by_sqlalchemy)


def test_other_errors_are_not_read_only() -> None:
    by_store = TransientDatabaseError("claim")
    by_store.driver_error = psycopg.errors.SerializationFailure("retry")

    assert not is_read_only(by_store)
    assert not is_read_only(psycopg.OperationalError("server closed the connection"))
    assert not is_read_only(ValueError("read-only"))


def test_only_a_new_server_is_a_move() -> None:
    moves: list[tuple[str, str]] = []
    tracker = ServerTracker(lambda old, new: moves.append((old, new)))

    for address in ("h1:5432", "h1:5432", "h2:5432", "h2:5432", "h1:5432"):
        tracker.seen(address)

    assert moves == [("h1:5432", "h2:5432"), ("h2:5432", "h1:5432")]
    assert tracker.address == "h1:5432"
