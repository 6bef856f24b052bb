"""Every error effect-outbox raises descends from :class:`OutboxError`.

Each class's docstring is its default message. Messages name the cause and, where
there is one, the fix; they never carry tool inputs, secrets or user text.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors


class OutboxError(Exception):
    """effect-outbox failed."""

    driver_error: BaseException | None = None

    def __init__(self, message: str | None = None, **context: Any) -> None:
        self.message = message or (self.__doc__ or "").strip()
        self.context = context
        super().__init__(self.message)


class ConfigurationError(OutboxError):
    """The runtime is misconfigured."""


class ContractRefused(OutboxError):
    """This tool contract cannot be made safe and was not registered."""


class ToolNotRegistered(OutboxError):
    """No tool with this name and version is registered."""


class InputRejected(OutboxError):
    """The tool input failed validation; nothing was recorded."""

    def __init__(self, message: str | None = None, *, problems: list[str] | None = None) -> None:
        super().__init__(message, problems=problems or [])
        self.problems = problems or []


class DecisionConflict(OutboxError):
    """This decision key was already recorded with a different intent; nothing was recorded."""


class OperationNotFound(OutboxError):
    """No operation has this id."""


class MalformedOperationId(OperationNotFound):
    """What a person typed is no operation id at all: a usage error (``outbox`` exits 2,
    as for a bad flag), where a well-formed id no operation has is not found (exit 1)."""


class InputRefused(OutboxError):
    """What a person typed is not acceptable (evidence, a reference, a lifetime); nothing
    was changed. The message is the one sentence every front end shows."""


class IllegalTransition(OutboxError):
    """The state machine forbids this transition; nothing was changed."""


class LeaseLost(IllegalTransition):
    """The lease token no longer matches: another worker owns this operation now."""


class CallbackRefused(OutboxError):
    """A provider callback was refused before anything was recorded."""

    def __init__(self, reason: str, message: str | None = None) -> None:
        # The reason is a metric label: signature, timestamp, too_large or malformed. The
        # message names the check that failed, never a header or a byte of the body.
        super().__init__(message or f"callback refused: {reason}", reason=reason)
        self.reason = reason


class ServiceUnavailable(OutboxError):
    """Postgres or RabbitMQ could not be reached."""


class SchemaMissing(OutboxError):
    """The outbox tables are missing in this database: run `outbox migrate`."""


class TopologyMissing(ConfigurationError):
    """The broker lacks the exchanges and queues: run `outbox migrate --broker`."""


class DatabaseError(OutboxError):
    """The database refused or failed an outbox operation."""


class UniqueViolation(DatabaseError):
    """A uniqueness constraint refused the write."""

    def __init__(self, message: str | None = None, *, constraint: str | None = None) -> None:
        super().__init__(message, constraint=constraint)
        self.constraint = constraint


class TransientDatabaseError(DatabaseError):
    """The database failed in a way that a new transaction may not: retry the transaction."""


class DecisionBlocked(TransientDatabaseError):
    """A decision waited its lock timeout (5 s unless ``record_decision`` was given
    another) for a lock another session holds (a LOCK TABLE, a transaction holding the
    same decision key) and was not recorded: nothing was written. Retry it, with the
    same decision key, once that session ends."""


class ReadOnlyDatabase(TransientDatabaseError):
    """The server took no write: it is a standby, or a primary demoted by a failover.
    The connection must be dropped, so that the next one finds the writable host (a URL
    naming several hosts with ``target_session_attrs=read-write``); retrying on it would
    fail the same way forever."""


def is_read_only(error: BaseException) -> bool:
    """Whether ``error`` is a write refused as read-only, raised by the store
    (:class:`ReadOnlyDatabase`) or by the driver, however wrapped (SQLAlchemy keeps the
    driver's error on ``.orig``, the store on ``driver_error``)."""
    seen: BaseException | None = error
    for _ in range(4):  # a wrapper's wrapper at most; a cycle must not loop forever
        if seen is None:
            return False
        if isinstance(seen, ReadOnlyDatabase | psycopg.errors.ReadOnlySqlTransaction):
            return True
        inner = getattr(seen, "driver_error", None) or getattr(seen, "orig", None)
        seen = inner if isinstance(inner, BaseException) else seen.__cause__
    return False


_TRANSIENT_SQLSTATE_CLASSES = ("08", "40", "53", "57")


def _unwrap(exc: BaseException) -> BaseException:
    """SQLAlchemy wraps driver errors; the driver's error is on ``.orig``."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


@contextlib.contextmanager
def wrap_database_errors(action: str) -> Iterator[None]:
    """Translate driver errors into outbox errors, the one place this happens.

    Messages keep the SQLSTATE and constraint name, never the statement's parameters
    or the server's DETAIL line (it quotes key values). The driver error is kept on
    ``driver_error`` for code, and the chain is cut so a logged traceback cannot
    print it.
    """
    try:
        yield
    except OutboxError:
        raise
    except Exception as exc:
        driver_error = _unwrap(exc)
        if not isinstance(driver_error, psycopg.Error):
            raise
        error = _translate(action, driver_error)
        error.driver_error = driver_error
        raise error from None


def _translate(action: str, driver_error: psycopg.Error) -> OutboxError:
    diag = driver_error.diag
    constraint = diag.constraint_name
    sqlstate = driver_error.sqlstate or ""
    # A missing table, or a schema older than this library (no outbox_record_decision):
    # either way `outbox migrate` is the fix.
    if isinstance(driver_error, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedFunction):
        return SchemaMissing()
    if isinstance(driver_error, psycopg.errors.UniqueViolation):
        return UniqueViolation(
            f"{action}: unique constraint {constraint!r} refused the write", constraint=constraint
        )
    if constraint == "operations_input_bounded":
        # The Python path refuses these first; only input recorded around it meets this.
        return InputRejected(
            f"{action}: the database refused the input: {diag.message_primary}",
            problems=["input outside the database's bounds"],
        )
    if constraint in ("operations_legal_transition", "operations_terminal"):
        return IllegalTransition(
            f"{action}: the database refused it: {diag.message_primary or 'illegal transition'}"
        )
    if isinstance(driver_error, psycopg.errors.ReadOnlySqlTransaction):
        return ReadOnlyDatabase(
            f"{action}: the write was refused as read-only (SQLSTATE 25006, "
            "ReadOnlySqlTransaction): a standby or a demoted primary, where reconnecting "
            "finds the writable host, or a session that is read-only by design"
        )
    if isinstance(driver_error, psycopg.OperationalError) or sqlstate.startswith(
        _TRANSIENT_SQLSTATE_CLASSES
    ):
        return TransientDatabaseError(
            f"{action}: transient database failure "
            f"(SQLSTATE {sqlstate or 'none'}, {type(driver_error).__name__})"
        )
    detail = f"constraint {constraint!r}" if constraint else type(driver_error).__name__
    return DatabaseError(f"{action}: database error (SQLSTATE {sqlstate or 'none'}, {detail})")


# libpq's text for why a connection failed -> ours. Its own messages can quote the
# connection parameters (a URL it cannot parse is quoted whole), so they are matched,
# never printed. The server's FATAL lines come in the server's language: an unmatched
# one is named by its class only.
_CONNECT_CAUSES = tuple(
    (re.compile(pattern), cause)
    for pattern, cause in (
        (r'database "[^"]*" does not exist', "the database does not exist"),
        (r'role "[^"]*" does not exist', "the user (role) does not exist"),
        (r"password authentication failed", "password authentication failed"),
        (r"no password supplied", "the server asks for a password and none was given"),
        (r"no pg_hba\.conf entry", "the server's pg_hba.conf admits no such connection"),
        (r"permission denied for database", "the user may not connect to this database"),
        (r"the database system is (starting|shutting|in recovery)", "the server is not ready"),
        (r"too many clients|remaining connection slots", "the server has no free connection"),
        (r"Connection refused", "connection refused"),
        (r"could not translate host name", "the host name does not resolve"),
        (r"timeout expired", "the connection timed out"),
        (r"No route to host|Network is unreachable", "the host is unreachable"),
    )
)


# What to do about a cause connect_failure names, where the daemon cannot fix it by
# waiting: said once in each retry line beside the cause.
_CONNECT_ADVICE = {
    "the database does not exist": (
        "create it with `outbox migrate` (it creates a missing database), or correct the "
        "database name in OUTBOX_DATABASE_URL"
    ),
    "the user (role) does not exist": (
        "create the login role, or correct the user in OUTBOX_DATABASE_URL"
    ),
    "password authentication failed": "correct the password in OUTBOX_DATABASE_URL",
    "the user may not connect to this database": "GRANT CONNECT ON DATABASE to the user",
}


def connect_failure(error: BaseException) -> str:
    """Why connecting to Postgres failed, in words fit for any log line or message."""
    driver_error = getattr(error, "driver_error", None)
    if isinstance(driver_error, BaseException):
        error = driver_error
    text = str(error)
    for pattern, cause in _CONNECT_CAUSES:
        if pattern.search(text):
            return cause
    return type(error).__name__


def connect_advice(cause: str) -> str | None:
    """What an operator does about a cause :func:`connect_failure` named, when waiting
    will not fix it; None when it may (a server restarting, a network away)."""
    return _CONNECT_ADVICE.get(cause)
