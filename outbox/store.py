"""The store: the only code that executes SQL.

Each named operation is written once, as a *plan*: a generator that yields
``(query name, parameters)`` steps and receives each step's rows. A sync runner and
an async runner drive the same plan over whatever connection the caller holds:

- SQLAlchemy 2 ``Connection`` or ``Session``, or plain ``psycopg.Connection``;
- SQLAlchemy ``AsyncConnection`` or ``AsyncSession``, or ``psycopg.AsyncConnection``.

Plans run inside the caller's transaction and never commit: the caller's commit is
what makes an operation, its outbox row and its event exist, together or not at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, Protocol, TypeVar
from uuid import UUID, uuid4

import psycopg
import psycopg.errors
import psycopg.rows
import psycopg.sql
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb
from sqlalchemy import event as sa_event
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine as SAEngine
from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
from sqlalchemy.ext.asyncio import AsyncSession as SAAsyncSession
from sqlalchemy.orm import Session as SASession

from outbox import lifecycle
from outbox.errors import (
    ConfigurationError,
    DatabaseError,
    DecisionConflict,
    IllegalTransition,
    LeaseLost,
    OperationNotFound,
    SchemaMissing,
    TransientDatabaseError,
    wrap_database_errors,
)
from outbox.fingerprint_key import key_from_environment, keyed_fingerprint
from outbox.models import (
    Approval,
    ApprovalCheck,
    ApprovalDecision,
    ApprovalStatus,
    Operation,
    OperationEvent,
    OutboxRow,
    RecordedDecision,
)
from outbox.sql import QUERIES, roles_sql, schema_sql
from outbox.states import FENCED_SOURCES, EventName, OperationState, is_legal, legal_targets

Row = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class Step:
    query: str
    params: Mapping[str, Any]


Plan = Generator[Step, list[Row], T]

SyncConnection = SAConnection | SASession | psycopg.Connection[Any]
AsyncConnection = SAAsyncConnection | SAAsyncSession | psycopg.AsyncConnection[Any]


# --- executors: one per connection flavour, all speaking psycopg underneath ----------


class _SyncExecutor(Protocol):
    def fetch(self, step: Step) -> list[Row]: ...


class _AsyncExecutor(Protocol):
    async def fetch(self, step: Step) -> list[Row]: ...


# Statements whose answer never changes for a database: asked once per process and
# database, then answered from memory (a round trip saved on every decision).
_IMMUTABLE_QUERIES = frozenset({"fingerprint_key"})
_remembered: dict[tuple[str, str], list[Row]] = {}


def _database_of(driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    # Per user too: each role proves on its own that it may read what it is served.
    info = driver.info
    return f"{info.user}@{info.host}:{info.port}/{info.dbname}"


def _check_driver_connection(driver: object, require_transaction: bool) -> None:
    if not isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
        raise ConfigurationError(
            f"effect-outbox needs the psycopg 3 driver, got {type(driver).__module__}."
            f"{type(driver).__name__}; use a postgresql+psycopg:// URL"
        )
    if (
        require_transaction
        and driver.autocommit
        and driver.info.transaction_status == TransactionStatus.IDLE
    ):
        raise ConfigurationError(
            "the connection is in autocommit mode outside a transaction: the operation, its "
            "outbox row and its event would not commit together. Open a transaction first "
            "(engine.begin(), session.begin(), or psycopg's conn.transaction())"
        )


# Lifecycle lines of a plan run on a SQLAlchemy connection wait in the DBAPI connection's
# info for the transaction's end: written when it commits, dropped when it rolls back.
# SQLAlchemy's "commit" event fires as the commit is issued, so a commit that then fails
# still writes them; a plain psycopg connection has no such event, so there they are
# written as each plan finishes (the caller's rollback cannot take them back).
_HELD_LINES = "outbox_lifecycle_lines"
_ENGINES_OBSERVED: weakref.WeakSet[SAEngine] = weakref.WeakSet()


def _hold_until_commit(connection: SAConnection, lines: list[lifecycle.Line]) -> None:
    if not lines:
        return
    engine = connection.engine
    if engine not in _ENGINES_OBSERVED:
        sa_event.listen(engine, "commit", _write_held_lines)
        sa_event.listen(engine, "rollback", _drop_held_lines)
        _ENGINES_OBSERVED.add(engine)
    connection.info.setdefault(_HELD_LINES, []).extend(lines)


def _write_held_lines(connection: SAConnection) -> None:
    lifecycle.write_all(connection.info.pop(_HELD_LINES, []))


def _drop_held_lines(connection: SAConnection) -> None:
    connection.info.pop(_HELD_LINES, None)


class _SQLAlchemyExecutor:
    def __init__(self, connection: SAConnection, require_transaction: bool) -> None:
        _check_driver_connection(connection.connection.driver_connection, require_transaction)
        self._connection = connection

    @property
    def commit_observer(self) -> SAConnection:
        return self._connection

    @property
    def database(self) -> str:
        driver = self._connection.connection.driver_connection
        assert isinstance(driver, psycopg.Connection)
        return _database_of(driver)

    def fetch(self, step: Step) -> list[Row]:
        result = self._connection.exec_driver_sql(QUERIES[step.query].sql, dict(step.params))
        return [dict(row) for row in result.mappings()] if result.returns_rows else []


class _PsycopgExecutor:
    def __init__(self, connection: psycopg.Connection[Any], require_transaction: bool) -> None:
        _check_driver_connection(connection, require_transaction)
        self._connection = connection

    @property
    def database(self) -> str:
        return _database_of(self._connection)

    def fetch(self, step: Step) -> list[Row]:
        with self._connection.cursor(row_factory=psycopg.rows.dict_row) as cursor:
            cursor.execute(QUERIES[step.query].sql, step.params)
            return cursor.fetchall() if cursor.description else []


class _SQLAlchemyAsyncExecutor:
    def __init__(self, connection: SAAsyncConnection, require_transaction: bool) -> None:
        self._connection = connection
        self._require_transaction = require_transaction
        self._checked = False

    @property
    def commit_observer(self) -> SAConnection | None:
        return self._connection.sync_connection

    @property
    def database(self) -> str:
        sync = self._connection.sync_connection
        driver = sync.connection.driver_connection if sync is not None else None
        assert isinstance(driver, psycopg.AsyncConnection)
        return _database_of(driver)

    async def fetch(self, step: Step) -> list[Row]:
        if not self._checked:
            raw = await self._connection.get_raw_connection()
            _check_driver_connection(raw.driver_connection, self._require_transaction)
            self._checked = True
        result = await self._connection.exec_driver_sql(QUERIES[step.query].sql, dict(step.params))
        return [dict(row) for row in result.mappings()] if result.returns_rows else []


class _PsycopgAsyncExecutor:
    def __init__(self, connection: psycopg.AsyncConnection[Any], require_transaction: bool) -> None:
        _check_driver_connection(connection, require_transaction)
        self._connection = connection

    @property
    def database(self) -> str:
        return _database_of(self._connection)

    async def fetch(self, step: Step) -> list[Row]:
        async with self._connection.cursor(row_factory=psycopg.rows.dict_row) as cursor:
            await cursor.execute(QUERIES[step.query].sql, step.params)
            return await cursor.fetchall() if cursor.description else []


def _sync_executor(connection: SyncConnection, require_transaction: bool) -> _SyncExecutor:
    if isinstance(connection, SASession):
        return _SQLAlchemyExecutor(connection.connection(), require_transaction)
    if isinstance(connection, SAConnection):
        return _SQLAlchemyExecutor(connection, require_transaction)
    if isinstance(connection, psycopg.Connection):
        return _PsycopgExecutor(connection, require_transaction)
    raise ConfigurationError(_unsupported(connection, "a sync"))


async def _async_executor(connection: AsyncConnection, require_transaction: bool) -> _AsyncExecutor:
    if isinstance(connection, SAAsyncSession):
        return _SQLAlchemyAsyncExecutor(await connection.connection(), require_transaction)
    if isinstance(connection, SAAsyncConnection):
        return _SQLAlchemyAsyncExecutor(connection, require_transaction)
    if isinstance(connection, psycopg.AsyncConnection):
        return _PsycopgAsyncExecutor(connection, require_transaction)
    raise ConfigurationError(_unsupported(connection, "an async"))


def _unsupported(connection: object, flavour: str) -> str:
    return (
        f"{type(connection).__name__} is not {flavour} connection effect-outbox can use; pass "
        "a SQLAlchemy Connection/Session (AsyncConnection/AsyncSession for async) or a "
        "psycopg (Async)Connection"
    )


# --- runners ------------------------------------------------------------------------


class Store:
    """Runs plans on a sync connection, inside the caller's transaction.

    ``require_transaction=False`` admits an autocommit connection, for statements that
    stand alone (LISTEN, reads); anything that writes related rows keeps the default.
    """

    def __init__(self, connection: SyncConnection, *, require_transaction: bool = True) -> None:
        self._executor = _sync_executor(connection, require_transaction)

    def run(self, plan: Plan[T]) -> T:
        observer = getattr(self._executor, "commit_observer", None)
        if observer is None:
            return self._run(plan)
        with lifecycle.held() as lines:
            result = self._run(plan)
        _hold_until_commit(observer, lines)
        return result

    def _run(self, plan: Plan[T]) -> T:
        rows: list[Row] | None = None
        try:
            while True:
                step = plan.send(rows) if rows is not None else next(plan)
                remembered = _remembered_rows(self._executor, step)
                if remembered is not None:
                    rows = remembered
                    continue
                with wrap_database_errors(step.query):
                    rows = self._executor.fetch(step)
                _remember(self._executor, step, rows)
        except StopIteration as finished:
            return finished.value  # type: ignore[no-any-return]


class AsyncStore:
    """Runs plans on an async connection, inside the caller's transaction."""

    def __init__(self, executor: _AsyncExecutor) -> None:
        self._executor = executor

    @classmethod
    async def on(
        cls, connection: AsyncConnection, *, require_transaction: bool = True
    ) -> AsyncStore:
        return cls(await _async_executor(connection, require_transaction))

    async def run(self, plan: Plan[T]) -> T:
        observer = getattr(self._executor, "commit_observer", None)
        if observer is None:
            return await self._run(plan)
        with lifecycle.held() as lines:
            result = await self._run(plan)
        _hold_until_commit(observer, lines)
        return result

    async def _run(self, plan: Plan[T]) -> T:
        rows: list[Row] | None = None
        try:
            while True:
                step = plan.send(rows) if rows is not None else next(plan)
                remembered = _remembered_rows(self._executor, step)
                if remembered is not None:
                    rows = remembered
                    continue
                with wrap_database_errors(step.query):
                    rows = await self._executor.fetch(step)
                _remember(self._executor, step, rows)
        except StopIteration as finished:
            return finished.value  # type: ignore[no-any-return]


def _remembered_rows(executor: object, step: Step) -> list[Row] | None:
    if step.query not in _IMMUTABLE_QUERIES:
        return None
    database = getattr(executor, "database", None)
    return _remembered.get((database, step.query)) if database else None


def _remember(executor: object, step: Step, rows: list[Row]) -> None:
    if step.query in _IMMUTABLE_QUERIES and rows:
        database = getattr(executor, "database", None)
        if database:
            _remembered[(database, step.query)] = rows


# --- plans: the named operations ----------------------------------------------------


@dataclass(frozen=True)
class NewDecision:
    """A validated, fingerprinted decision, ready to be written."""

    run_id: str
    decision_key: str | None
    tool_name: str
    tool_version: int
    side_effect: str
    input: dict[str, Any]
    input_fingerprint: str
    requires_approval: bool
    headers: dict[str, str]


def fingerprint_key() -> Plan[str]:
    """The key of the short fingerprints logs, events and spans show:
    ``OUTBOX_FINGERPRINT_KEY`` if set, else the database's (asked once per process)."""
    from_environment = key_from_environment()
    if from_environment is not None:
        return from_environment
    rows = yield Step("fingerprint_key", {})
    if not rows:
        raise SchemaMissing()
    key: str = rows[0]["fingerprint_key"]
    return key


def record_decision(decision: NewDecision) -> Plan[RecordedDecision]:
    """Insert operation + outbox row + prepared event, or return the one already there."""
    key = yield from fingerprint_key()
    attributes: dict[str, lifecycle.Scalar] = {
        "tool": decision.tool_name,
        "tool_version": decision.tool_version,
        "fingerprint": keyed_fingerprint(key, decision.input_fingerprint),
        "run_id": decision.run_id,
    }
    # A key-holder that rolls back between our insert and our read frees the key again;
    # then our decision is still unrecorded and the insert is tried once more.
    for _ in range(3):
        rows = yield Step(
            "insert_decision",
            {
                "id": uuid4(),
                "run_id": decision.run_id,
                "decision_key": decision.decision_key,
                "tool_name": decision.tool_name,
                "tool_version": decision.tool_version,
                "side_effect": decision.side_effect,
                "input": Jsonb(decision.input),
                "input_fingerprint": decision.input_fingerprint,
                "requires_approval": decision.requires_approval,
                "headers": Jsonb(decision.headers),
                "event_attributes": Jsonb(attributes),
            },
        )
        if rows:
            operation = Operation.model_validate(rows[0])
            lifecycle.emit(EventName.PREPARED, operation, attributes)
            return RecordedDecision(operation=operation, created=True)
        rows = yield Step(
            "get_operation_by_decision_key",
            {"run_id": decision.run_id, "decision_key": decision.decision_key},
        )
        if rows:
            existing = Operation.model_validate(rows[0])
            _refuse_changed_intent(existing, decision, key)
            return RecordedDecision(operation=existing, created=False)
    raise TransientDatabaseError(
        "the decision key kept changing hands between insert and read; retry the transaction"
    )


def _refuse_changed_intent(existing: Operation, decision: NewDecision, key: str) -> None:
    if (
        existing.input_fingerprint == decision.input_fingerprint
        and existing.tool_name == decision.tool_name
        and existing.tool_version == decision.tool_version
    ):
        return
    raise DecisionConflict(
        f"decision key already recorded in this run for {existing.display_id} "
        f"(tool {existing.tool_name!r} v{existing.tool_version}, fingerprint "
        f"{keyed_fingerprint(key, existing.input_fingerprint)}); the new intent has "
        f"fingerprint {keyed_fingerprint(key, decision.input_fingerprint)}. Use a new "
        "decision key for a new decision",
        operation_id=existing.id,
    )


def find_operation(operation_id: UUID) -> Plan[Operation | None]:
    rows = yield Step("get_operation", {"id": operation_id})
    return Operation.model_validate(rows[0]) if rows else None


def get_operation(operation_id: UUID) -> Plan[Operation]:
    operation = yield from find_operation(operation_id)
    if operation is None:
        raise OperationNotFound(f"no operation with id {operation_id}")
    return operation


def claim(operation_id: UUID, *, owner: str, lease: timedelta) -> Plan[Operation | None]:
    """prepared -> in_flight with a new fencing token; None if another claim won.

    Commit this before calling the provider: the claim is what makes a second worker
    (or a redelivered message) see the operation as taken.
    """
    claimed = yield from claim_many([(operation_id, lease)], owner=owner)
    return claimed.get(operation_id)


def find_operations(operation_ids: Sequence[UUID]) -> Plan[dict[UUID, Operation]]:
    """Many operations by id in one round trip; ids with no operation are absent."""
    rows = yield Step("get_operations", {"ids": list(operation_ids)})
    operations = (Operation.model_validate(row) for row in rows)
    return {operation.id: operation for operation in operations}


def claim_many(
    claims: Sequence[tuple[UUID, timedelta]], *, owner: str
) -> Plan[dict[UUID, Operation]]:
    """:func:`claim` for many operations in one statement, each with its own lease.

    Operations another claim won (or that are not due) are absent from the result. As
    with :func:`claim`, commit this before calling any provider.
    """
    if any(lease <= timedelta(0) for _, lease in claims):
        raise ValueError("lease must be positive")
    if not claims:
        return {}
    rows = yield Step(
        "claim_operations",
        {
            "ids": [operation_id for operation_id, _ in claims],
            "leases": [lease for _, lease in claims],
            "owner": owner,
        },
    )
    claimed: dict[UUID, Operation] = {}
    for row in rows:
        operation = Operation.model_validate(row)
        lifecycle.emit(
            EventName.ATTEMPTED,
            operation,
            {"attempt": operation.attempts, "lease_token": operation.lease_token},
        )
        claimed[operation.id] = operation
    return claimed


@dataclass(frozen=True)
class ConfirmedEffect:
    """A provider confirmed the effect of an operation this worker holds in flight."""

    operation: Operation
    """As claimed: in flight, under the lease token the write must still hold."""
    provider_reference: str | None
    result: Mapping[str, Any]
    attributes: Mapping[str, lifecycle.Scalar]


def commit_many(effects: Sequence[ConfirmedEffect]) -> Plan[dict[UUID, Operation]]:
    """``in_flight -> committed`` for many operations in one statement, each only under
    its own fencing token, with the event :func:`transition` would append.

    An operation whose token is stale or that left ``in_flight`` is absent from the
    result and unchanged; settle it with :func:`transition`, which says why.
    """
    if not effects:
        return {}
    attributes = [
        {
            "from": str(OperationState.IN_FLIGHT),
            "to": str(OperationState.COMMITTED),
            **effect.attributes,
            **(
                {"provider_reference": effect.provider_reference}
                if effect.provider_reference is not None
                else {}
            ),
        }
        for effect in effects
    ]
    rows = yield Step(
        "commit_operations",
        {
            "ids": [effect.operation.id for effect in effects],
            "lease_tokens": [effect.operation.lease_token for effect in effects],
            "provider_references": [effect.provider_reference for effect in effects],
            "results": [Jsonb(dict(effect.result)) for effect in effects],
            "event_attributes": [Jsonb(event) for event in attributes],
        },
    )
    events = {effect.operation.id: event for effect, event in zip(effects, attributes, strict=True)}
    committed: dict[UUID, Operation] = {}
    for row in rows:
        operation = Operation.model_validate(row)
        lifecycle.emit(EventName.COMMITTED, operation, events[operation.id])
        committed[operation.id] = operation
    return committed


_DEFAULT_EVENTS = {
    OperationState.COMMITTED: EventName.COMMITTED,
    OperationState.REJECTED: EventName.REJECTED,
    OperationState.PREPARED: EventName.RETRY_SCHEDULED,
    OperationState.OUTCOME_UNKNOWN: EventName.OUTCOME_UNKNOWN,
    OperationState.ESCALATED: EventName.ESCALATED,
}


def transition(
    operation_id: UUID,
    *,
    source: OperationState,
    target: OperationState,
    lease_token: int | None = None,
    event: EventName | None = None,
    attributes: Mapping[str, str | int | float | bool | None] | None = None,
    provider_reference: str | None = None,
    result: Mapping[str, Any] | None = None,
    error_class: str | None = None,
    delay: timedelta | None = None,
    reconcile_attempt: bool = False,
    requeue: bool | None = None,
) -> Plan[Operation]:
    """Move one operation ``source -> target`` if, and only if, it is still in ``source``
    and (for fenced sources) still under ``lease_token``.

    Appends the lifecycle event in the same statement. Moving to ``prepared`` queues a
    fresh outbox row available after ``delay`` unless ``requeue=False`` (an operation
    that waits for an approval is queued by the grant instead). Raises
    :class:`IllegalTransition` for an edge the state machine forbids,
    :class:`LeaseLost` when the token is stale, and changes nothing in either case.
    """
    if target is OperationState.IN_FLIGHT:
        raise IllegalTransition("use claim() to move an operation in_flight")
    if not is_legal(source, target):
        raise IllegalTransition(
            f"{source} -> {target} is not a legal transition; from {source} an operation "
            f"may go to: {', '.join(legal_targets(source)) or 'nowhere (terminal)'}"
        )
    if source in FENCED_SOURCES and lease_token is None:
        raise IllegalTransition(
            f"leaving {source} needs the lease token of the claim that put it there"
        )
    event_name = event or _DEFAULT_EVENTS[target]
    event_attributes = {"from": str(source), "to": str(target), **(attributes or {})}
    if provider_reference is not None:
        event_attributes["provider_reference"] = provider_reference
    if error_class is not None:
        event_attributes.setdefault("reason", error_class)
    rows = yield Step(
        "transition_operation",
        {
            "id": operation_id,
            "source": str(source),
            "target": str(target),
            "lease_token": lease_token,
            "provider_reference": provider_reference,
            "result": Jsonb(dict(result)) if result is not None else None,
            "error_class": error_class,
            "delay": delay,
            "reconcile_increment": 1 if reconcile_attempt else 0,
            "event_name": str(event_name),
            "event_attributes": Jsonb(event_attributes),
            "requeue": target is OperationState.PREPARED if requeue is None else requeue,
        },
    )
    if rows:
        operation = Operation.model_validate(rows[0])
        lifecycle.emit(event_name, operation, event_attributes)
        return operation
    current = yield from get_operation(operation_id)
    if current.state is not source:
        raise IllegalTransition(
            f"{current.display_id} is {current.state}, not {source}: another process moved "
            "it first; nothing was changed"
        )
    raise LeaseLost(
        f"{current.display_id} is now under lease token {current.lease_token}, not "
        f"{lease_token}: another worker took it over; nothing was changed"
    )


def events(operation_id: UUID) -> Plan[list[OperationEvent]]:
    rows = yield Step("list_events", {"operation_id": operation_id})
    return [OperationEvent.model_validate(row) for row in rows]


def outbox_rows(operation_id: UUID) -> Plan[list[OutboxRow]]:
    rows = yield Step("list_outbox_rows", {"operation_id": operation_id})
    return [OutboxRow.model_validate(row) for row in rows]


def decide_approval(
    operation_id: UUID,
    *,
    decision: ApprovalDecision,
    approved_by: str,
    ttl: timedelta,
    intent_hash: str | None = None,
) -> Plan[Approval]:
    """Record a grant or denial bound to the operation's intent.

    ``intent_hash`` is the fingerprint the person was shown; None binds the grant to
    the operation's own fingerprint. A grant for a prepared operation also queues a
    fresh outbox row, in the same statement.
    """
    if not approved_by.strip():
        raise ValueError("approved_by must name the person who decided")
    if ttl <= timedelta(0):
        raise ValueError("an approval needs a positive time to live")
    rows = yield Step(
        "insert_approval",
        {
            "id": uuid4(),
            "operation_id": operation_id,
            "intent_hash": intent_hash,
            "decision": str(decision),
            "approved_by": approved_by,
            "ttl": ttl,
        },
    )
    if not rows:
        raise OperationNotFound(f"no operation with id {operation_id}")
    approval = Approval.model_validate(rows[0])
    operation = yield from get_operation(operation_id)
    name = (
        EventName.APPROVAL_GRANTED
        if decision is ApprovalDecision.GRANTED
        else EventName.APPROVAL_DENIED
    )
    # Who decided is in the approvals row; a log line carries ids, never people's names.
    lifecycle.emit(name, operation, {"approval_id": str(approval.id)})
    return approval


def check_approval(operation_id: UUID) -> Plan[ApprovalCheck]:
    """Is there a grant this operation's effect may be attempted under, right now?"""
    rows = yield Step("latest_approval", {"operation_id": operation_id})
    if not rows:
        raise OperationNotFound(f"no operation with id {operation_id}")
    row = rows[0]
    if row["id"] is None:
        return ApprovalCheck(
            status=ApprovalStatus.MISSING, reason="no approval was granted for this operation"
        )
    approval = Approval.model_validate(row)
    if approval.decision is ApprovalDecision.DENIED:
        status, reason = ApprovalStatus.DENIED, f"denied by {approval.approved_by}"
    elif approval.expires_at <= row["checked_at"]:
        status, reason = ApprovalStatus.EXPIRED, f"the grant expired at {approval.expires_at}"
    elif approval.intent_hash != row["operation_fingerprint"]:
        status, reason = (
            ApprovalStatus.INTENT_CHANGED,
            f"the grant approved intent {approval.intent_hash[:12]}, the operation's intent is "
            f"{row['operation_fingerprint'][:12]}",
        )
    else:
        status, reason = ApprovalStatus.VALID, f"granted by {approval.approved_by}"
    return ApprovalCheck(status=status, reason=reason, approval=approval)


# --- schema: DDL and databases, on plain psycopg connections -----------------------

# pg_advisory_xact_lock key shared by every migrating process ("outbox" in ASCII).
_MIGRATION_LOCK = 0x6F7574626F78


def apply_schema(connection: psycopg.Connection[Any]) -> int:
    """Apply ``schema.sql`` in the connection's transaction; returns the schema version.

    Concurrent callers queue on an advisory lock, so two migrations never interleave.
    """
    with wrap_database_errors("apply_schema"):
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        connection.execute(schema_sql().encode())
        return schema_version(connection) or 0


# The NOLOGIN group roles roles.sql creates, one per component.
ROLES = ("outbox_agent", "outbox_dispatcher", "outbox_consumer", "outbox_operator")


def apply_roles(connection: psycopg.Connection[Any]) -> tuple[str, ...]:
    """Apply ``roles.sql`` in the connection's transaction; returns the group roles.

    Run it after :func:`apply_schema` (the grants name its tables), usually in the same
    transaction. It queues on the same advisory lock, so it never interleaves with a
    migration of this database.
    """
    with wrap_database_errors("apply_roles"):
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        connection.execute(roles_sql().encode())
    return ROLES


def schema_version(connection: psycopg.Connection[Any]) -> int | None:
    """The highest applied schema version, or None when the schema is absent."""
    with wrap_database_errors("schema_version"):
        exists = connection.execute("SELECT to_regclass('outbox_schema_version')").fetchone()
        if exists is None or exists[0] is None:
            return None
        row = connection.execute("SELECT max(version) FROM outbox_schema_version").fetchone()
        return None if row is None else row[0]


def schema_is_current(connection: psycopg.Connection[Any]) -> bool:
    """Whether this library's schema is applied: the newest table it needs exists. Asks
    the catalog only, which needs no grant, so a least-privilege role can tell too."""
    with wrap_database_errors("schema_is_current"):
        row = connection.execute(
            "SELECT to_regclass('outbox_deployment') IS NOT NULL"
            " AND to_regproc('outbox_notify_operation_changed') IS NOT NULL"
        ).fetchone()
    return row is not None and bool(row[0])


def create_database(
    connection: psycopg.Connection[Any], name: str, *, template: str | None = None
) -> bool:
    """CREATE DATABASE on an autocommit connection; False if it already existed."""
    statement = psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name))
    if template is not None:
        statement += psycopg.sql.SQL(" TEMPLATE {}").format(psycopg.sql.Identifier(template))
    try:
        with wrap_database_errors("create_database"):
            connection.execute(statement)
    except DatabaseError as error:
        if isinstance(error.driver_error, psycopg.errors.DuplicateDatabase):
            return False
        raise
    return True


def drop_database(connection: psycopg.Connection[Any], name: str) -> None:
    """DROP DATABASE IF EXISTS ... WITH (FORCE), on an autocommit connection."""
    statement = psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
        psycopg.sql.Identifier(name)
    )
    with wrap_database_errors("drop_database"):
        connection.execute(statement)


def database_exists(connection: psycopg.Connection[Any], name: str) -> bool:
    with wrap_database_errors("database_exists"):
        row = connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        return row.fetchone() is not None


# --- dispatcher: claim, mark, measure, prune ----------------------------------------

NOTIFY_CHANNEL = "outbox_pending"


class ClaimedRow(NamedTuple):
    """An outbox row locked by this transaction, with what its message needs.

    A NamedTuple rather than a frozen dataclass: one is built per message on the
    dispatcher's hot path, and this is the cheapest immutable record to construct.
    """

    id: int
    operation_id: UUID
    routing_key: str
    headers: dict[str, Any]
    publish_attempts: int
    """Failed publishes of this row so far."""
    ready_seconds: float
    """How long the row has been available, by the database's clock, at claim time."""
    tool_name: str
    tool_version: int
    input_fingerprint: str


@dataclass(frozen=True)
class FailedPublish:
    outbox_id: int
    error: str
    delay: timedelta


@dataclass(frozen=True)
class Backlog:
    pending: int
    oldest_age_seconds: float


def claim_outbox_batch(batch_size: int) -> Plan[list[ClaimedRow]]:
    """Lock up to ``batch_size`` publishable rows until this transaction ends.

    Claimed by state (``published_at IS NULL``) in id order with SKIP LOCKED, never by
    a high-water mark: ids are assigned before commit, not in commit order.
    """
    rows = yield Step("claim_outbox_batch", {"batch_size": batch_size})
    return [ClaimedRow(**row) for row in rows]


def mark_outbox_published(outbox_ids: list[int]) -> Plan[None]:
    if outbox_ids:
        yield Step("mark_outbox_published", {"ids": outbox_ids})


def mark_outbox_failed(failures: list[FailedPublish]) -> Plan[None]:
    if failures:
        yield Step(
            "mark_outbox_failed",
            {
                "ids": [f.outbox_id for f in failures],
                "errors": [f.error for f in failures],
                "delays": [f.delay for f in failures],
            },
        )


def outbox_backlog() -> Plan[Backlog]:
    rows = yield Step("outbox_backlog", {})
    return Backlog(pending=rows[0]["pending"], oldest_age_seconds=rows[0]["oldest_age_seconds"])


def delete_published_outbox_rows(retention: timedelta, limit: int) -> Plan[int]:
    rows = yield Step("delete_published_outbox_rows", {"retention": retention, "limit": limit})
    return int(rows[0]["deleted"])


def listen_outbox_pending() -> Plan[None]:
    """LISTEN on the channel the outbox insert trigger notifies (autocommit connection)."""
    yield Step("listen_outbox_pending", {})


# --- agents awaiting outcomes --------------------------------------------------------


def listen_operation_changes() -> Plan[None]:
    """LISTEN on the channel every new operation event notifies (autocommit connection)."""
    yield Step("listen_operation_changes", {})


def operation_outcomes(operation_ids: Sequence[UUID]) -> Plan[list[Row]]:
    """The status rows of many operations in one round trip; ids with no visible
    operation are absent. :mod:`outbox.awaiting` folds each into an ``Outcome``."""
    rows = yield Step("operation_outcomes", {"ids": list(operation_ids)})
    return rows


def operation_outcomes_changed(known: Mapping[UUID, int | None]) -> Plan[list[Row]]:
    """:func:`operation_outcomes` for the operations in ``known`` (id -> the row version
    the caller read last, None if never) that changed since, with their new
    ``row_version``; an unchanged operation is absent, and so is an id with no operation."""
    rows = yield Step(
        "operation_outcomes_changed",
        {"ids": list(known), "row_versions": list(known.values())},
    )
    return rows


# --- consumer and reconciler ---------------------------------------------------------


def append_event(
    operation: Operation, name: EventName, attributes: Mapping[str, lifecycle.Scalar]
) -> Plan[None]:
    """Record a lifecycle event that moves no state (an approval wait, for instance)."""
    yield Step(
        "insert_event",
        {"operation_id": operation.id, "name": str(name), "attributes": Jsonb(dict(attributes))},
    )
    lifecycle.emit(name, operation, attributes)


def claim_reconciliation_batch(limit: int) -> Plan[list[Operation]]:
    """Lock (until this transaction ends) unknown outcomes due for a lookup and in-flight
    operations whose lease expired: their worker died or stalled, so the effect may
    have happened."""
    rows = yield Step("claim_reconciliation_batch", {"limit": limit})
    return [Operation.model_validate(row) for row in rows]


def lease_for_reconciliation(
    operation: Operation, *, owner: str, lease: timedelta
) -> Plan[Operation | None]:
    """A reconciler's lease on an unknown outcome, with a new fencing token."""
    rows = yield Step(
        "lease_for_reconciliation",
        {"id": operation.id, "owner": owner, "lease": lease, "lease_token": operation.lease_token},
    )
    return Operation.model_validate(rows[0]) if rows else None


def defer_reconciliation(
    operation_id: UUID, *, lease_token: int, reason: str, delay: timedelta
) -> Plan[Operation]:
    """An inconclusive lookup: count it and look again after ``delay``."""
    rows = yield Step(
        "defer_reconciliation",
        {"id": operation_id, "lease_token": lease_token, "reason": reason, "delay": delay},
    )
    if not rows:
        current = yield from get_operation(operation_id)
        raise LeaseLost(
            f"{current.display_id} is {current.state} under lease token {current.lease_token}, "
            f"not outcome_unknown under {lease_token}; nothing was changed"
        )
    operation = Operation.model_validate(rows[0])
    lifecycle.emit(
        EventName.RECONCILE_DEFERRED,
        operation,
        {"reason": reason, "reconcile_attempt": operation.reconcile_attempts},
    )
    return operation


def requeue_stale_prepared(stale_after: timedelta, limit: int) -> Plan[list[UUID]]:
    """Give prepared operations whose message never led anywhere a new outbox row.

    A message can be dead-lettered (a database outage outlasting its delivery limit) or
    lost with a broker's disk; the operation row stays ``prepared`` and would otherwise
    wait forever. Operations waiting for an approval are left to their grant.
    """
    rows = yield Step("requeue_stale_prepared", {"stale_after": stale_after, "limit": limit})
    return [row["operation_id"] for row in rows]


def escalate_undeliverable(
    stale_after: timedelta, cycles: int, limit: int
) -> Plan[list[tuple[UUID, str]]]:
    """Hand to a person the stale prepared operations already queued again ``cycles``
    times: their messages keep reaching no consumer that can run them (an unknown tool,
    a poison message), and queueing them once more would loop forever. Returns each
    one's id and tool."""
    rows = yield Step(
        "escalate_undeliverable", {"stale_after": stale_after, "cycles": cycles, "limit": limit}
    )
    return [(row["operation_id"], row["tool_name"]) for row in rows]


def reject_denied_operations(grace: timedelta, limit: int) -> Plan[list[UUID]]:
    """End as rejected the prepared operations whose latest approval decision is a
    denial older than ``grace``: a decision denied and never granted is a definitive no."""
    rows = yield Step("reject_denied_operations", {"grace": grace, "limit": limit})
    return [row["operation_id"] for row in rows]


# --- metrics -------------------------------------------------------------------------


def operations_by_state() -> Plan[dict[OperationState, int]]:
    """Operations per state, every state present (0 when it has no rows), so a gauge
    set from it drops back to 0 instead of keeping its last non-zero value."""
    rows = yield Step("operations_by_state", {})
    counts = dict.fromkeys(OperationState, 0)
    counts.update((OperationState(row["state"]), int(row["operations"])) for row in rows)
    return counts


# --- operator commands: list, show, resolve, approvals, stats ------------------------


RESOLUTION_EVIDENCE_LIMIT = 500


@dataclass(frozen=True)
class OperationSummary:
    """What an operator sees of an operation in a listing: everything but its input."""

    id: UUID
    run_id: str
    tool_name: str
    tool_version: int
    side_effect: str
    input_fingerprint: str
    requires_approval: bool
    state: OperationState
    attempts: int
    reconcile_attempts: int
    provider_reference: str | None
    last_error_class: str | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Row) -> OperationSummary:
        return cls(**{**row, "state": OperationState(row["state"])})


@dataclass(frozen=True)
class PendingApproval:
    operation: OperationSummary
    check: ApprovalCheck


@dataclass(frozen=True)
class OperationStats:
    by_tool: dict[str, dict[str, int]]
    """tool name -> state -> operations."""
    backlog: Backlog
    pending_approvals: int


def list_operation_summaries(
    *,
    states: list[OperationState] | None = None,
    tool: str | None = None,
    since: datetime | None = None,
    within: timedelta | None = None,
    limit: int = 50,
) -> Plan[list[OperationSummary]]:
    """Operations by last change, newest first. ``within`` is measured on the database's
    clock, so a skewed operator machine cannot shift the window."""
    rows = yield Step(
        "list_operation_summaries",
        {
            "states": [str(s) for s in states] if states else None,
            "tool": tool,
            "since": since,
            "ago": within,
            "limit": limit,
        },
    )
    return [OperationSummary.from_row(row) for row in rows]


def pending_approvals() -> Plan[list[PendingApproval]]:
    """Prepared operations that need an approval and have no valid one.

    Each candidate goes through :func:`check_approval`, the rule the consumer applies,
    so what this lists is exactly what the consumer would refuse to execute.
    """
    rows = yield Step("list_approval_candidates", {})
    pending = []
    for row in rows:
        summary = OperationSummary.from_row(row)
        check = yield from check_approval(summary.id)
        if not check.is_valid:
            pending.append(PendingApproval(operation=summary, check=check))
    return pending


def operation_stats() -> Plan[OperationStats]:
    rows = yield Step("count_operations_by_tool_and_state", {})
    by_tool: dict[str, dict[str, int]] = {}
    for row in rows:
        by_tool.setdefault(row["tool_name"], {})[row["state"]] = int(row["operations"])
    backlog = yield from outbox_backlog()
    pending = yield from pending_approvals()
    return OperationStats(by_tool=by_tool, backlog=backlog, pending_approvals=len(pending))


def resolve_operation(
    operation_id: UUID,
    *,
    source: OperationState,
    target: OperationState,
    decision: str,
    resolved_by: str,
    evidence: str,
    provider_reference: str | None = None,
) -> Plan[Operation]:
    """A person settles an operation: ``source -> target`` with an
    ``operation.resolved`` event carrying their name, their decision and their evidence.

    The evidence is the operator's own free text, written to be kept with the operation:
    it is stored (truncated) in the event, and never logged. Moving to ``prepared``
    queues a fresh outbox row available at once: the resolution authorizes a retry.
    """
    if not resolved_by.strip():
        raise ValueError("resolved_by must name the person who resolved the operation")
    if not evidence.strip():
        raise ValueError("a resolution needs evidence")
    if not is_legal(source, target):
        raise IllegalTransition(
            f"{source} -> {target} is not a legal transition; from {source} an operation "
            f"may go to: {', '.join(legal_targets(source)) or 'nowhere (terminal)'}"
        )
    if source in FENCED_SOURCES:
        raise IllegalTransition(
            f"a person cannot resolve an operation that is {source}: a worker holds it"
        )
    logged: dict[str, lifecycle.Scalar] = {
        "from": str(source),
        "to": str(target),
        "decision": decision,
    }
    if provider_reference is not None:
        logged["provider_reference"] = provider_reference
    # Who and why are kept in the event, where they belong; a log line carries ids.
    stored = {**logged, "by": resolved_by, "evidence": evidence[:RESOLUTION_EVIDENCE_LIMIT]}
    retry = target is OperationState.PREPARED
    rows = yield Step(
        "transition_operation",
        {
            "id": operation_id,
            "source": str(source),
            "target": str(target),
            "lease_token": None,
            "provider_reference": provider_reference,
            "result": None,
            "error_class": None,
            # A retry the person authorized is due now, not after a lookup's backoff.
            "delay": timedelta(0) if retry else None,
            "reconcile_increment": 0,
            "event_name": str(EventName.RESOLVED),
            "event_attributes": Jsonb(stored),
            "requeue": retry,
        },
    )
    if not rows:
        current = yield from get_operation(operation_id)
        raise IllegalTransition(
            f"{current.display_id} is {current.state}, not {source}: another process moved "
            "it first; nothing was changed"
        )
    operation = Operation.model_validate(rows[0])
    lifecycle.emit(EventName.RESOLVED, operation, logged)
    return operation


# --- chaos: ending the daemons' database sessions -------------------------------------


def terminate_backends(connection: psycopg.Connection[Any], application_names: list[str]) -> int:
    """End every session of these applications in the connection's own database; how
    many ended. For ``outbox chaos``: another database's sessions, and the caller's own,
    are never touched, because other work shares the server."""
    statement = psycopg.sql.SQL(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = ANY(%s) "
        "AND pid <> pg_backend_pid()"
    )
    with wrap_database_errors("terminate_backends"):
        row = connection.execute(statement, (application_names,)).fetchone()
    return int(row[0]) if row else 0


def session_snapshot(connection: psycopg.Connection[Any]) -> list[str]:
    """Every other session in the connection's own database, one line each: who, in what
    state, how long in its transaction, what it waits for, and the head of its statement
    (parameters are sent apart, so no values). For ``outbox chaos``'s evidence when a run
    does not settle: a session idle in a transaction for minutes holds locks."""
    statement = psycopg.sql.SQL(
        "SELECT pid, application_name, state, "
        "round(extract(epoch FROM clock_timestamp() - xact_start)::numeric, 1), "
        "wait_event_type, wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 160) "
        "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "ORDER BY xact_start NULLS LAST"
    )
    with wrap_database_errors("session_snapshot"):
        rows = connection.execute(statement).fetchall()
    return [
        f"pid={pid} app={app or '-'} state={state} in_transaction_s={age} "
        f"waits={wait_type or '-'}:{wait or '-'} query={query!r}"
        for pid, app, state, age, wait_type, wait, query in rows
    ]
