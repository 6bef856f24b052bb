"""The provider breaker's statements (run by the consumer; read by operators): its row
decided under a row lock by :mod:`outbox.breaker`, its ``provider.unavailable`` and
``provider.available`` events, and the operations that wait for a provider."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from outbox import breaker, lifecycle
from outbox.breaker import BreakerRules, Failure, ProviderHealth
from outbox.errors import LeaseLost
from outbox.models import Operation
from outbox.states import EventName
from outbox.store.operations import get_operation
from outbox.store.runner import Plan, Row, Step


@dataclass(frozen=True)
class HealthChange:
    """What one write did to a provider's breaker, read under its lock."""

    before: ProviderHealth
    after: ProviderHealth
    now: datetime
    """The database's clock when the row was locked."""

    @property
    def opened(self) -> bool:
        return self.before.available and not self.after.available

    @property
    def closed(self) -> bool:
        return not self.before.available and self.after.available


@dataclass(frozen=True)
class ProviderRow:
    """A provider's breaker as ``outbox providers`` and the console show it."""

    health: ProviderHealth
    now: datetime
    last_event_at: datetime | None


def provider_health(providers: Sequence[str]) -> Plan[tuple[dict[str, ProviderHealth], datetime]]:
    """The breakers of ``providers`` that have a row (no row: closed, never failed), and
    the database's clock."""
    rows = yield Step("provider_health_rows", {"providers": list(providers)})
    health = {
        row["provider"]: ProviderHealth.model_validate(row)
        for row in rows
        if row["provider"] is not None
    }
    now: datetime = rows[0]["now"]
    return health, now


def provider_still_unavailable(provider: str) -> Plan[bool]:
    """Whether the provider's breaker is open or half-open, read under a share lock kept
    until the transaction ends. A wait written after it in the same transaction is
    either seen by the answer that closes the breaker (which waits for this lock, then
    releases the waiting operations) or written knowing the breaker closed."""
    rows = yield Step("share_provider_health", {"provider": provider})
    return bool(rows) and rows[0]["state"] != "closed"


def all_providers() -> Plan[list[ProviderRow]]:
    rows = yield Step("all_provider_health", {})
    return [
        ProviderRow(ProviderHealth.model_validate(row), row["now"], row["last_event_at"])
        for row in rows
    ]


def provider_events(provider: str, limit: int = 20) -> Plan[list[Row]]:
    rows = yield Step("list_provider_events", {"provider": provider, "limit": limit})
    return rows


def record_provider_failure(
    provider: str,
    failure: Failure,
    *,
    rules: BreakerRules,
    rng: random.Random | None = None,
) -> Plan[HealthChange]:
    """A call of ``provider`` that got no answer (or a request to slow down), decided
    under the row's lock; appends ``provider.unavailable`` if it opened the breaker."""
    change = yield from _change(
        provider,
        lambda health, now: breaker.after_failure(health, failure, now=now, rules=rules, rng=rng),
        create=True,
    )
    assert change is not None  # ensured just before
    if change.opened:
        after = change.after
        yield from _event(
            provider,
            "provider.unavailable",
            {
                "outage_started_at": _iso(after.outage_started_at),
                "failing_operations": len(after.failing_operations),
                "last_failure": after.last_failure,
                "next_probe_at": _iso(after.next_probe_at),
            },
        )
    return change


def record_provider_answer(
    provider: str, *, tools: Sequence[str], release_spread: timedelta
) -> Plan[HealthChange | None]:
    """The provider answered a call: its breaker closes and its streak is forgotten.
    Closing appends ``provider.available`` (how long, how many probes, how many
    operations waited) and releases the operations of ``tools`` that wait, each due
    within ``release_spread``. None when the provider has no row."""
    change = yield from _change(
        provider, lambda health, now: breaker.after_answer(health, now=now), create=False
    )
    if change is None or not change.closed:
        return change
    before = change.before
    waited = yield Step("count_waited_operations", {"tools": list(tools)})
    released = yield Step(
        "release_waiting_operations", {"tools": list(tools), "spread": release_spread}
    )
    started = before.outage_started_at or change.now
    yield from _event(
        provider,
        "provider.available",
        {
            "outage_started_at": _iso(before.outage_started_at),
            "outage_seconds": round((change.now - started).total_seconds(), 3),
            "probes": before.probes,
            "operations_waited": int(waited[0]["waited"]),
            "operations_released": int(released[0]["released"]),
        },
    )
    return change


def take_provider_probe(
    provider: str, *, owner: str, lease: timedelta
) -> Plan[ProviderHealth | None]:
    """The probe of an open breaker for ``owner``, if one is due: half-open under
    ``owner`` for ``lease``. None when another process holds it or none is due."""
    won: list[ProviderHealth] = []

    def take(health: ProviderHealth, now: datetime) -> ProviderHealth:
        taken = breaker.take_probe(health, owner=owner, lease=lease, now=now)
        if taken is None:
            return health
        won.append(taken)
        return taken

    yield from _change(provider, take, create=False)
    return won[0] if won else None


def book_provider_call(
    provider: str, *, interval: timedelta, burst: int, horizon: timedelta
) -> Plan[float | None]:
    """A call's turn under the provider's declared rate: the seconds it waits for it (0
    within the burst), or None when the turns booked already reach past ``horizon`` and
    none was booked."""
    yield Step("ensure_provider_health", {"provider": provider})
    rows = yield Step(
        "book_provider_call",
        {
            "provider": provider,
            "interval": interval,
            "tolerance": interval * (burst - 1),
            "horizon": horizon,
        },
    )
    return float(rows[0]["wait_seconds"]) if rows else None


def take_provider_call(
    provider: str, operation_id: UUID, *, limit: int, hold: timedelta
) -> Plan[datetime | None]:
    """A place among the calls out to ``provider`` (at most ``limit`` at once), for the
    call of ``operation_id``, held until the call ends or ``hold`` runs out. Decided under
    the breaker row's lock, so two consumers never both take the last place. None when
    granted; otherwise when the soonest call out ends at the latest."""
    yield Step("ensure_provider_health", {"provider": provider})
    yield Step("lock_provider_health", {"provider": provider})
    rows = yield Step(
        "take_provider_call",
        {"provider": provider, "operation_id": operation_id, "limit": limit, "hold": hold},
    )
    if rows[0]["granted"]:
        return None
    soonest: datetime = rows[0]["soonest"]
    return soonest


def give_back_provider_call(provider: str, operation_id: UUID) -> Plan[None]:
    """The call of ``operation_id`` is over: its place goes to the next one."""
    yield Step("give_back_provider_call", {"provider": provider, "operation_id": operation_id})


def nominate_probe(tools: Sequence[str]) -> Plan[UUID | None]:
    """The waiting operation of ``tools`` due soonest, due now: the call that probes an
    open breaker whose probe is due. None when none waits, or one is due within a
    second already."""
    rows = yield Step("nominate_probe", {"tools": list(tools)})
    return rows[0]["id"] if rows else None


def wait_prepared(
    delays: Sequence[tuple[Operation, timedelta]], *, provider: str, reason: str
) -> Plan[set[UUID]]:
    """Prepared, due operations held back by their provider: due again after each one's
    delay, with a fresh outbox row then, their wait begun if it had not (an
    ``operation.waiting`` event and its lifecycle line). Counts no attempt. Returns the
    ids it moved."""
    rows = yield Step(
        "wait_prepared_for_provider",
        {
            "ids": [operation.id for operation, _ in delays],
            "delays": [delay for _, delay in delays],
            "provider": provider,
            "reason": reason,
        },
    )
    began = {row["id"] for row in rows if row["began"]}
    for operation, _ in delays:
        if operation.id in began:
            lifecycle.emit(
                EventName.WAITING,
                operation,
                {"provider": provider, "reason": reason, "state": "prepared"},
            )
    return {row["id"] for row in rows}


def wait_unknown(
    operation: Operation,
    *,
    delay: timedelta,
    provider: str,
    reason: str,
    waiting: bool = True,
) -> Plan[Operation]:
    """An unknown outcome whose provider could not be asked now: lease released, looked
    up again after ``delay``, no lookup counted; its wait for the provider begun unless
    ``waiting`` is False (its turn under a declared rate is merely further off). Raises
    :class:`LeaseLost` if another process moved it since ``operation`` was read."""
    rows = yield Step(
        "wait_unknown_for_provider",
        {
            "id": operation.id,
            "lease_token": operation.lease_token,
            "delay": delay,
            "provider": provider,
            "reason": reason,
            "waiting": waiting,
        },
    )
    if not rows:
        current = yield from get_operation(operation.id)
        raise LeaseLost(
            f"{current.display_id} is {current.state} under lease token {current.lease_token}, "
            f"not outcome_unknown under {operation.lease_token}; nothing was changed"
        )
    waited = Operation.model_validate(rows[0])
    if waiting and operation.waiting_since is None:
        # Read with the row (claim_reconciliation_batch selects every column): the wait
        # begins here, as the statement's event says.
        lifecycle.emit(
            EventName.WAITING,
            waited,
            {"provider": provider, "reason": reason, "state": "outcome_unknown"},
        )
    return waited


def waiting_operations_by_tool() -> Plan[dict[str, int]]:
    rows = yield Step("waiting_operations_by_tool", {})
    return {str(row["tool_name"]): int(row["waiting"]) for row in rows}


def _change(
    provider: str,
    decide: Callable[[ProviderHealth, datetime], ProviderHealth],
    *,
    create: bool,
) -> Plan[HealthChange | None]:
    if create:
        yield Step("ensure_provider_health", {"provider": provider})
    rows = yield Step("lock_provider_health", {"provider": provider})
    if not rows:
        return None
    now: datetime = rows[0]["now"]
    before = ProviderHealth.model_validate(rows[0])
    after = decide(before, now)
    if after != before:
        yield Step(
            "write_provider_health",
            {
                **after.model_dump(exclude={"updated_at"}),
                "state": str(after.state),
                "failing_operations": list(after.failing_operations),
            },
        )
    return HealthChange(before, after, now)


def _event(provider: str, name: str, attributes: dict[str, Any]) -> Plan[None]:
    yield Step(
        "insert_provider_event",
        {"provider": provider, "name": name, "attributes": Jsonb(attributes)},
    )


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="milliseconds")
