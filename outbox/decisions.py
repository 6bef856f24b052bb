"""Recording an agent's decision: the entry point an agent service calls.

Validation, canonicalization and fingerprinting happen before anything touches the
database (:mod:`outbox.intent`); bad input raises :class:`InputRejected` and writes
nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg.errors
from pydantic import BaseModel

from outbox import store, tracing
from outbox.bounds import DECISION_LOCK_TIMEOUT
from outbox.contracts import Registry
from outbox.errors import ConfigurationError, DatabaseError, DecisionBlocked
from outbox.intent import prepare_decision
from outbox.models import Approval, ApprovalCheck, ApprovalDecision, RecordedDecision
from outbox.store import AsyncConnection, AsyncStore, Store, SyncConnection


def _traceparent_or_current(traceparent: str | None) -> str | None:
    # An explicit traceparent wins; otherwise an agent running inside an OpenTelemetry
    # span propagates it without passing anything (None when OTel is absent).
    return traceparent if traceparent is not None else tracing.current_traceparent()


def _check_own_transaction(own_transaction: bool, decision_key: str | None) -> None:
    if own_transaction and decision_key is None:
        raise ConfigurationError(
            "own_transaction=True needs a decision_key: the statement commits as it runs, "
            "so a call cut off mid-statement may have recorded the decision, and only the "
            "key lets its retry find it instead of recording it twice"
        )


def record_decision(
    connection: SyncConnection,
    registry: Registry,
    tool: str,
    tool_input: Mapping[str, Any] | BaseModel,
    *,
    run_id: str,
    decision_key: str | None = None,
    tool_version: int | None = None,
    traceparent: str | None = None,
    own_transaction: bool = False,
    lock_timeout: float = DECISION_LOCK_TIMEOUT,
) -> RecordedDecision:
    """Record an agent decision in the caller's transaction.

    Writes the operation (``prepared``), its outbox row and its ``operation.prepared``
    event in one statement; they become visible together when the caller commits, and
    vanish together if it rolls back. With a ``decision_key`` the call is idempotent per
    ``(run_id, decision_key)``: the same intent returns the existing operation
    (``created=False``), a different intent raises :class:`DecisionConflict`.
    ``tool_version`` None means the latest registered version. ``traceparent`` None
    takes the active OpenTelemetry span's, if the ``otel`` extra is installed.

    ``own_transaction=True`` records the decision as a transaction of its own, when
    nothing else must commit with it: the connection must be in autocommit mode outside
    a transaction block, and the statement commits as it runs, one round trip instead of
    three (BEGIN, the statement, COMMIT). A ``decision_key`` is then required: a call
    whose connection fails mid-statement may have committed (in a transaction only a
    lost COMMIT leaves that open), and the key is how its retry finds the decision
    instead of recording a second one. Without the flag an autocommit connection is
    refused, since the caller's other writes would not commit with the decision.

    ``lock_timeout`` is how many seconds the statement waits for a lock another session
    holds (a ``LOCK TABLE``, a transaction holding the same decision key): 5 by default,
    at most 60 (``OUTBOX_DECISION_LOCK_TIMEOUT`` for ``outbox mcp``). Past it the call
    raises :class:`DecisionBlocked` and nothing is written: retry it with the same
    decision key. The caller's session keeps its own ``lock_timeout``.
    """
    _check_own_transaction(own_transaction, decision_key)
    decision = prepare_decision(
        registry,
        tool,
        tool_input,
        run_id=run_id,
        decision_key=decision_key,
        tool_version=tool_version,
        traceparent=_traceparent_or_current(traceparent),
    )
    with _blocked_said(lock_timeout):
        return Store(connection, own_transaction=own_transaction).run(
            store.record_decision(decision, lock_timeout=lock_timeout)
        )


async def record_decision_async(
    connection: AsyncConnection,
    registry: Registry,
    tool: str,
    tool_input: Mapping[str, Any] | BaseModel,
    *,
    run_id: str,
    decision_key: str | None = None,
    tool_version: int | None = None,
    traceparent: str | None = None,
    own_transaction: bool = False,
    lock_timeout: float = DECISION_LOCK_TIMEOUT,
) -> RecordedDecision:
    """The async twin of :func:`record_decision`."""
    _check_own_transaction(own_transaction, decision_key)
    decision = prepare_decision(
        registry,
        tool,
        tool_input,
        run_id=run_id,
        decision_key=decision_key,
        tool_version=tool_version,
        traceparent=_traceparent_or_current(traceparent),
    )
    runner = await AsyncStore.on(connection, own_transaction=own_transaction)
    with _blocked_said(lock_timeout):
        return await runner.run(store.record_decision(decision, lock_timeout=lock_timeout))


@contextlib.contextmanager
def _blocked_said(lock_timeout: float) -> Iterator[None]:
    """A decision that waited out its lock timeout raises :class:`DecisionBlocked`,
    saying what the agent can do about it."""
    try:
        yield
    except DatabaseError as error:
        if not isinstance(error.driver_error, psycopg.errors.LockNotAvailable):
            raise
        raise DecisionBlocked(
            f"the decision waited {lock_timeout:g} s for a lock another session holds and "
            "was not recorded; nothing was written: retry it with the same decision key"
        ) from error


def grant_approval(
    connection: SyncConnection,
    operation_id: UUID,
    *,
    approved_by: str,
    ttl: timedelta,
    intent_hash: str | None = None,
) -> Approval:
    """Grant approval for one operation and intent; queues the operation again."""
    return Store(connection).run(
        store.decide_approval(
            operation_id,
            decision=ApprovalDecision.GRANTED,
            approved_by=approved_by,
            ttl=ttl,
            intent_hash=intent_hash,
        )
    )


async def grant_approval_async(
    connection: AsyncConnection,
    operation_id: UUID,
    *,
    approved_by: str,
    ttl: timedelta,
    intent_hash: str | None = None,
) -> Approval:
    """The async twin of :func:`grant_approval`."""
    plan = store.decide_approval(
        operation_id,
        decision=ApprovalDecision.GRANTED,
        approved_by=approved_by,
        ttl=ttl,
        intent_hash=intent_hash,
    )
    return await (await AsyncStore.on(connection)).run(plan)


def check_approval(connection: SyncConnection, operation_id: UUID) -> ApprovalCheck:
    """Valid, missing, expired, denied or intent changed: may the effect be attempted?"""
    return Store(connection).run(store.check_approval(operation_id))


async def check_approval_async(connection: AsyncConnection, operation_id: UUID) -> ApprovalCheck:
    """The async twin of :func:`check_approval`."""
    return await (await AsyncStore.on(connection)).run(store.check_approval(operation_id))
