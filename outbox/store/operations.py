"""The operations every component shares: recording a decision, reading operations,
claiming and committing them, moving them along the state machine, and their events
and outbox rows.

Each function is a plan (see :mod:`outbox.store.runner`): it names its statements and
the runner executes them in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

from psycopg.types.json import Jsonb

from outbox import lifecycle
from outbox.bounds import (
    DECISION_LOCK_TIMEOUT,
    MAX_DECISION_LOCK_TIMEOUT,
    bounded_reference,
    bounded_result,
    object_or_unreadable,
)
from outbox.errors import (
    ConfigurationError,
    DecisionConflict,
    IllegalTransition,
    LeaseLost,
    OperationNotFound,
    SchemaMissing,
    TransientDatabaseError,
)
from outbox.fingerprint_key import key_from_environment, keyed_fingerprint
from outbox.models import Operation, OperationEvent, OutboxRow, RecordedDecision
from outbox.states import (
    FENCED_SOURCES,
    EventName,
    OperationState,
    Waiting,
    is_legal,
    legal_targets,
)
from outbox.store.runner import Plan, Step


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


def record_decision(
    decision: NewDecision, *, lock_timeout: float = DECISION_LOCK_TIMEOUT
) -> Plan[RecordedDecision]:
    """Insert operation + outbox row + prepared event, or return the one already there.

    The insert waits at most ``lock_timeout`` seconds for a lock (from 1 ms to
    ``MAX_DECISION_LOCK_TIMEOUT``), then fails with ``LockNotAvailable``, nothing
    written. Each statement is whole on its own (the insert writes the three rows at
    once, the rest read), so the plan may also run with each statement committing as it
    runs."""
    # Written so that NaN is refused too: every comparison with it is false.
    if not 0.001 <= lock_timeout <= MAX_DECISION_LOCK_TIMEOUT:
        raise ConfigurationError(
            f"a decision's lock timeout is 0.001 to {MAX_DECISION_LOCK_TIMEOUT:g} seconds, "
            f"not {lock_timeout!r}"
        )
    lock_timeout_ms = max(1, round(lock_timeout * 1000))
    key = yield from fingerprint_key()
    # The log line's fields. The event's attributes are written by the database function
    # from its own arguments (tool, version, run); the short fingerprint, which needs the
    # deployment's key, is shown from the row by whoever reads it.
    attributes: dict[str, lifecycle.Scalar] = {
        "tool": decision.tool_name,
        "tool_version": decision.tool_version,
        "fingerprint": keyed_fingerprint(key, decision.input_fingerprint),
        "run_id": decision.run_id,
    }
    # A key-holder that rolls back between our insert and our read frees the key again;
    # then our decision is still unrecorded and the insert is tried once more.
    for _ in range(3):
        new_id = uuid4()
        rows = yield Step(
            "insert_decision",
            {
                "id": new_id,
                "run_id": decision.run_id,
                "decision_key": decision.decision_key,
                "tool_name": decision.tool_name,
                "tool_version": decision.tool_version,
                "side_effect": decision.side_effect,
                "input": Jsonb(decision.input),
                "input_fingerprint": decision.input_fingerprint,
                "requires_approval": decision.requires_approval,
                "headers": Jsonb(decision.headers),
                "lock_timeout_ms": lock_timeout_ms,
            },
        )
        if rows and rows[0]["archived"] is not None:
            # The decision was recorded long ago and its operation moved to history
            # (schema.sql, outbox_history_archive): the function answers with it, from
            # the archived decision keys, and created nothing.
            archived = Operation.model_validate({**rows[0]["archived"], "input": decision.input})
            _refuse_changed_intent(archived, decision, key)
            return RecordedDecision(operation=archived, created=False)
        if rows:
            operation = _born(decision, new_id, rows[0]["created_at"])
            lifecycle.emit(EventName.PREPARED, operation, attributes)
            return RecordedDecision(operation=operation, created=True)
        rows = yield Step(
            "get_operation_by_decision_key",
            {"run_id": decision.run_id, "decision_key": decision.decision_key},
        )
        if rows:
            # The agent role may not read inputs, so the row comes without one; the same
            # fingerprint means the same canonical input, the one this call holds.
            existing = Operation.model_validate({**rows[0], "input": decision.input})
            _refuse_changed_intent(existing, decision, key)
            return RecordedDecision(operation=existing, created=False)
    raise TransientDatabaseError(
        "the decision key kept changing hands between insert and read; retry the transaction"
    )


def _born(decision: NewDecision, operation_id: UUID, recorded_at: datetime) -> Operation:
    """The operation a decision's insert has just created. Built rather than read back:
    besides the decision's own columns, a new row holds only what outbox_guard_birth
    (schema.sql) makes every new row hold, and decoding the whole row back cost the
    writer about 35 µs of a decision's 230 to 260."""
    return Operation.model_validate(
        {
            "id": operation_id,
            "run_id": decision.run_id,
            "decision_key": decision.decision_key,
            "tool_name": decision.tool_name,
            "tool_version": decision.tool_version,
            "side_effect": decision.side_effect,
            "input": decision.input,
            "input_fingerprint": decision.input_fingerprint,
            "requires_approval": decision.requires_approval,
            "state": OperationState.PREPARED,
            "attempts": 0,
            "reconcile_attempts": 0,
            "lease_token": 0,
            "lease_owner": None,
            "lease_expires_at": None,
            "next_attempt_at": recorded_at,
            "first_attempt_at": None,
            "provider_reference": None,
            "result": None,
            "last_error_class": None,
            "effect_possible": False,
            "created_at": recorded_at,
            "updated_at": recorded_at,
        }
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
class DeliveryClaim:
    """A delivered message's claim on its operation: what the message says the operation
    is (tool, version, fingerprint), and the lease to take if the row agrees."""

    operation_id: UUID
    tool_name: str
    tool_version: int
    input_fingerprint: str
    lease: timedelta


@dataclass(frozen=True)
class ClaimedDelivery:
    """An operation :func:`claim_deliveries` put in flight."""

    operation: Operation
    """As claimed: in flight, under its new lease and fencing token."""
    first_attempt_before: datetime | None
    """``first_attempt_at`` as it was before this claim (the claim sets it when unset)."""

    @property
    def before(self) -> Operation:
        """The row as the claim found it, as far as the consumer's checks read it: still
        prepared, one attempt fewer, its first attempt's time as it was."""
        return self.operation.model_copy(
            update={
                "state": OperationState.PREPARED,
                "attempts": self.operation.attempts - 1,
                "first_attempt_at": self.first_attempt_before,
            }
        )


def claim_deliveries(
    deliveries: Sequence[DeliveryClaim], *, owner: str
) -> Plan[dict[UUID, ClaimedDelivery]]:
    """:func:`claim_many` for a consumer's burst, without reading the operations first:
    one statement claims each operation that is prepared, due, needs no approval and
    matches what its message says, and returns it as claimed.

    Every other operation is absent from the result and unchanged: the caller reads and
    checks those as before a :func:`claim_many`. The caller checks what the claim
    returned (tampering, the replay window) before it commits, and rolls back if a check
    fails. One claim per operation id: a second delivery of an id is not claimed again.
    """
    if any(delivery.lease <= timedelta(0) for delivery in deliveries):
        raise ValueError("lease must be positive")
    unique = sorted(
        {delivery.operation_id: delivery for delivery in deliveries}.values(),
        key=lambda delivery: delivery.operation_id,
    )
    if not unique:
        return {}
    rows = yield Step(
        "claim_deliveries",
        {
            "ids": [delivery.operation_id for delivery in unique],
            "leases": [delivery.lease for delivery in unique],
            "tool_names": [delivery.tool_name for delivery in unique],
            "tool_versions": [delivery.tool_version for delivery in unique],
            "input_fingerprints": [delivery.input_fingerprint for delivery in unique],
            "owner": owner,
        },
    )
    claimed: dict[UUID, ClaimedDelivery] = {}
    for row in rows:
        first_attempt_before = row.pop("first_attempt_before")
        operation = Operation.model_validate(row)
        lifecycle.emit(
            EventName.ATTEMPTED,
            operation,
            {"attempt": operation.attempts, "lease_token": operation.lease_token},
        )
        claimed[operation.id] = ClaimedDelivery(operation, first_attempt_before)
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
                {"provider_reference": bounded_reference(effect.provider_reference)}
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
            "provider_references": [
                bounded_reference(effect.provider_reference) for effect in effects
            ],
            "results": [Jsonb(bounded_result(effect.result)) for effect in effects],
            "event_attributes": [Jsonb(event) for event in attributes],
        },
    )
    claimed = {effect.operation.id: effect.operation for effect in effects}
    events = {effect.operation.id: event for effect, event in zip(effects, attributes, strict=True)}
    committed: dict[UUID, Operation] = {}
    for row in rows:
        # The columns commit_operations wrote, read back as the row has them (the
        # trigger stamps updated_at and may replace the result with the unreadable
        # marker). The driver typed them already, and this worker wrote them under its
        # own fencing token: only the state and the result's shape are checked again.
        operation = claimed[row["id"]].model_copy(
            update={
                "state": OperationState(row["state"]),
                "lease_owner": row["lease_owner"],
                "lease_expires_at": row["lease_expires_at"],
                "provider_reference": row["provider_reference"],
                "result": object_or_unreadable(row["result"]),
                "updated_at": row["updated_at"],
            }
        )
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
    effect_disproved: bool = False,
    waiting: Waiting | None = None,
    attempt_refunded: bool = False,
) -> Plan[Operation]:
    """Move one operation ``source -> target`` if, and only if, it is still in ``source``
    and (for fenced sources) still under ``lease_token``.

    Appends the lifecycle event in the same statement. Moving to ``prepared`` queues a
    fresh outbox row available after ``delay`` unless ``requeue=False`` (an operation
    that waits for an approval is queued by the grant instead). Raises
    :class:`IllegalTransition` for an edge the state machine forbids,
    :class:`LeaseLost` when the token is stale, and changes nothing in either case.

    A move to ``outcome_unknown`` marks the operation ``effect_possible``; only
    ``effect_disproved`` (a lookup proved the effect absent: ``outcome_unknown ->
    prepared``) clears the mark, so no other move can make a possible effect look absent.

    ``waiting`` starts (or continues) the operation's wait for its provider, or ends it;
    None ends it at a settled or escalated target and keeps it otherwise.
    ``attempt_refunded`` gives back the attempt the claim counted, for a call the
    provider could not take: waiting spends no attempt.
    """
    if target is OperationState.IN_FLIGHT:
        raise IllegalTransition("use claim() to move an operation in_flight")
    if not is_legal(source, target):
        raise IllegalTransition(
            f"{source} -> {target} is not a legal transition; from {source} an operation "
            f"may go to: {', '.join(legal_targets(source)) or 'nowhere (terminal)'}"
        )
    if effect_disproved and (source, target) != (
        OperationState.OUTCOME_UNKNOWN,
        OperationState.PREPARED,
    ):
        raise IllegalTransition(
            "only a lookup of an unknown outcome (outcome_unknown -> prepared) can prove "
            "an effect absent"
        )
    if source in FENCED_SOURCES and lease_token is None:
        raise IllegalTransition(
            f"leaving {source} needs the lease token of the claim that put it there"
        )
    event_name = event or _DEFAULT_EVENTS[target]
    event_attributes = {"from": str(source), "to": str(target), **(attributes or {})}
    if provider_reference is not None:
        event_attributes["provider_reference"] = bounded_reference(provider_reference)
    if error_class is not None:
        event_attributes.setdefault("reason", error_class)
    rows = yield Step(
        "transition_operation",
        {
            "id": operation_id,
            "source": str(source),
            "target": str(target),
            "lease_token": lease_token,
            "provider_reference": bounded_reference(provider_reference),
            "result": Jsonb(bounded_result(result)) if result is not None else None,
            "error_class": error_class,
            "delay": delay,
            "reconcile_increment": 1 if reconcile_attempt else 0,
            "effect_disproved": effect_disproved,
            "event_name": str(event_name),
            "event_attributes": Jsonb(event_attributes),
            "requeue": target is OperationState.PREPARED if requeue is None else requeue,
            "waiting": str(waiting or _waiting_after(target)),
            "attempt_refund": 1 if attempt_refunded else 0,
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


def _waiting_after(target: OperationState) -> Waiting:
    if target in (OperationState.COMMITTED, OperationState.REJECTED, OperationState.ESCALATED):
        return Waiting.END
    return Waiting.KEEP


def events(operation_id: UUID) -> Plan[list[OperationEvent]]:
    """Every event of one operation, oldest first, in memory at once: for a reader that
    needs the whole timeline of an operation it knows to be short (the chaos harness's
    checker, the demo). The operator's front ends read pages (:func:`events_page`)."""
    rows = yield Step("list_events", {"operation_id": operation_id})
    return [OperationEvent.model_validate(row) for row in rows]


def outbox_rows(operation_id: UUID) -> Plan[list[OutboxRow]]:
    rows = yield Step("list_outbox_rows", {"operation_id": operation_id})
    return [OutboxRow.model_validate(row) for row in rows]


def report_agent_completed(operation_id: UUID, attributes: Mapping[str, Any]) -> Plan[int]:
    """What an agent says of an operation its own login recorded: keys ``agent.<name>``,
    at most 4096 bytes, 16 reports an operation. It waits, locking nothing a daemon
    takes, until the consumer's reconciler chains it as ``agent.completed``
    (:func:`chain_agent_reports`); returns the report's id."""
    rows = yield Step(
        "report_agent_completed",
        {"operation_id": operation_id, "attributes": Jsonb(dict(attributes))},
    )
    return int(rows[0]["report_id"])


def chain_agent_reports(limit: int) -> Plan[int]:
    """Move up to ``limit`` committed agent reports into their operations' chains, in
    this transaction (keep it short: each head stays locked to its end); how many."""
    rows = yield Step("chain_agent_reports", {"limit": limit})
    return int(rows[0]["chained"])


def append_event(
    operation: Operation, name: EventName, attributes: Mapping[str, lifecycle.Scalar]
) -> Plan[None]:
    """Record a lifecycle event that moves no state (an approval wait, for instance)."""
    yield Step(
        "insert_event",
        {"operation_id": operation.id, "name": str(name), "attributes": Jsonb(dict(attributes))},
    )
    lifecycle.emit(name, operation, attributes)
