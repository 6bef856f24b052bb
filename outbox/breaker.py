"""Provider health: one verdict per provider on whether it can be reached.

A provider that cannot be reached says nothing about any effect, and when calls of
several operations fail that way in a row it is down for all of them. The verdict is a
circuit breaker whose state is a row of ``provider_health``, so every consumer and the
reconciler read the same one (docs/design.md section 9):

- ``closed``: calls go through. Calls that could not reach the provider, from
  :attr:`BreakerRules.failures_to_open` different operations within
  :attr:`BreakerRules.window` and with no answer between them, open it.
- ``open``: nobody calls the provider; its operations wait and spend no attempt and no
  lookup. At ``next_probe_at`` one call may go out as the probe.
- ``half_open``: that probe is out, under ``probe_owner`` until ``probe_expires_at``.
  Its failure opens the breaker again with a longer pause; any answer closes it.

The provider's ``Retry-After`` is kept as ``not_before``, whatever the state: no call
before it. This module decides; :mod:`outbox.store.providers` reads and writes the row
under a lock, and the consumer asks.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from uuid import UUID

from pydantic import BaseModel, ConfigDict

from outbox.errors import ConfigurationError

# Codes of attempts and lookups that got no answer from the provider: a transport that
# failed before or after sending (outbox.http's codes), the runtime's own deadline on a
# lookup, and the signals that say so outright. A 5xx is the provider's gateway or
# server saying it cannot serve, not an answer about the effect.
_UNREACHED = frozenset(
    {
        "connect_failed",
        "connect_timeout",
        "connection_lost",
        "deadline_exceeded",
        "lookup_timeout",
        "http_408",
        "provider_unavailable",
        "provider_unreachable",
    }
)
_SERVER_ERROR = re.compile(r"^http_5[0-9][0-9]$")

# A streak remembers at most this many operations (the table's CHECK says the same).
_STREAK_AT_MOST = 100


def could_not_reach(code: str) -> bool:
    """Whether an attempt or lookup that ended with ``code`` got no answer from the
    provider. This is how a contract written before :class:`~outbox.outcomes.Unreachable`
    existed (a lookup answering ``StillUnknown("http_503")``) still waits instead of
    spending its lookups."""
    return code in _UNREACHED or bool(_SERVER_ERROR.fullmatch(code))


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class ProviderHealth(BaseModel):
    """One ``provider_health`` row."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    provider: str
    state: BreakerState = BreakerState.CLOSED
    failing_operations: tuple[UUID, ...] = ()
    failing_since: datetime | None = None
    last_failure: str | None = None
    outage_started_at: datetime | None = None
    """When the streak that opened the breaker began: the outage's start."""
    opened_at: datetime | None = None
    probes: int = 0
    next_probe_at: datetime | None = None
    probe_owner: str | None = None
    probe_expires_at: datetime | None = None
    not_before: datetime | None = None
    updated_at: datetime | None = None

    @property
    def available(self) -> bool:
        """Whether calls to the provider go through (a ``Retry-After`` only delays them)."""
        return self.state is BreakerState.CLOSED

    @property
    def clean(self) -> bool:
        """Closed with no streak: an answer changes nothing, so nothing is written."""
        return self.state is BreakerState.CLOSED and not self.failing_operations


@dataclass(frozen=True)
class BreakerRules:
    """When the breaker opens and how often an open one is probed."""

    failures_to_open: int = 5
    """Different operations whose calls could not reach the provider, in a row: enough
    that a provider dropping one answer in five does not open it by chance (five in a
    row, 1 in 3,125), few enough that an outage opens it within a handful of calls."""
    window: timedelta = timedelta(seconds=30)
    """The streak counts only failures this close to its first."""
    first_probe: timedelta = timedelta(seconds=1)
    longest_probe: timedelta = timedelta(seconds=10)
    """Probes back off from ``first_probe`` doubling up to this: a provider back from
    an outage is found within it (or its ``Retry-After``)."""

    def __post_init__(self) -> None:
        if self.failures_to_open < 2:
            raise ConfigurationError(
                "a breaker needs failures from at least 2 operations to open: one "
                "operation's failures say nothing about the provider"
            )
        if self.window <= timedelta(0) or self.first_probe <= timedelta(0):
            raise ConfigurationError("the breaker's window and first probe must be positive")
        if self.longest_probe < self.first_probe:
            raise ConfigurationError(
                "the breaker's longest probe pause must not be shorter than its first"
            )

    def probe_pause(self, probes: int, rng: random.Random | None = None) -> timedelta:
        """The pause before the next probe after ``probes`` failed ones, with a tenth of
        it drawn at random so consumers do not probe in step."""
        seconds = min(
            self.first_probe.total_seconds() * 2 ** min(probes, 30),
            self.longest_probe.total_seconds(),
        )
        draw = (rng or random).random()
        return timedelta(seconds=seconds * (0.9 + 0.1 * draw))


@dataclass(frozen=True)
class Failure:
    """A call that got no answer (or a request to slow down)."""

    operation_id: UUID
    code: str
    retry_after: timedelta | None = None
    prober: str | None = None
    """The probe this call was, if it was one: only the probe's failure reopens."""
    counts: bool = True
    """False for a rate limit: its Retry-After is honoured, but the provider is up."""


def after_failure(
    health: ProviderHealth,
    failure: Failure,
    *,
    now: datetime,
    rules: BreakerRules,
    rng: random.Random | None = None,
) -> ProviderHealth:
    """Where ``failure`` leaves the breaker."""
    not_before = health.not_before
    if failure.retry_after is not None:
        wanted = now + failure.retry_after
        not_before = wanted if not_before is None else max(not_before, wanted)
    if not failure.counts:
        return health.model_copy(update={"not_before": not_before, "updated_at": now})
    if health.state is BreakerState.CLOSED:
        fresh = health.failing_since is None or health.failing_since < now - rules.window
        failing = () if fresh else health.failing_operations
        if failure.operation_id not in failing:
            failing = (*failing, failure.operation_id)[-_STREAK_AT_MOST:]
        since = now if fresh or health.failing_since is None else health.failing_since
        if len(failing) < rules.failures_to_open:
            return health.model_copy(
                update={
                    "failing_operations": failing,
                    "failing_since": since,
                    "last_failure": failure.code,
                    "not_before": not_before,
                    "updated_at": now,
                }
            )
        return health.model_copy(
            update={
                "state": BreakerState.OPEN,
                "failing_operations": failing,
                "failing_since": since,
                "last_failure": failure.code,
                "outage_started_at": since,
                "opened_at": now,
                "probes": 0,
                "next_probe_at": _later(now + rules.probe_pause(0, rng), not_before),
                "not_before": not_before,
                "updated_at": now,
            }
        )
    if health.state is BreakerState.HALF_OPEN and failure.prober == health.probe_owner:
        return health.model_copy(
            update={
                "state": BreakerState.OPEN,
                "last_failure": failure.code,
                "next_probe_at": _later(now + rules.probe_pause(health.probes, rng), not_before),
                "probe_owner": None,
                "probe_expires_at": None,
                "not_before": not_before,
                "updated_at": now,
            }
        )
    # Open, or a call that left before the breaker opened and failed while a probe is
    # out: the verdict stands; only the provider's Retry-After is news.
    return health.model_copy(
        update={"last_failure": failure.code, "not_before": not_before, "updated_at": now}
    )


def after_answer(health: ProviderHealth, *, now: datetime) -> ProviderHealth:
    """The provider answered a call (any answer, even "no"): closed, streak forgotten.
    Its Retry-After still holds."""
    return ProviderHealth(provider=health.provider, not_before=health.not_before, updated_at=now)


def take_probe(
    health: ProviderHealth, *, owner: str, lease: timedelta, now: datetime
) -> ProviderHealth | None:
    """The breaker half-open under ``owner`` for ``lease``, if a probe is due; None if
    not (closed, a probe already out, or not yet time)."""
    if not probe_due(health, now=now):
        return None
    return health.model_copy(
        update={
            "state": BreakerState.HALF_OPEN,
            "probes": health.probes + 1,
            "probe_owner": owner,
            "probe_expires_at": now + lease,
            "updated_at": now,
        }
    )


def probe_due(health: ProviderHealth, *, now: datetime) -> bool:
    """Whether one call may now go out to find out if the provider is back."""
    if health.not_before is not None and health.not_before > now:
        return False
    if health.state is BreakerState.OPEN:
        return health.next_probe_at is None or health.next_probe_at <= now
    if health.state is BreakerState.HALF_OPEN:
        # The probe's holder died or stalled: another takes it over.
        return health.probe_expires_at is None or health.probe_expires_at <= now
    return False


class Go:
    """Call the provider."""


class Probe:
    """The breaker is open and a probe is due: call if this process wins the probe."""


@dataclass(frozen=True)
class Hold:
    """Do not call before ``until``."""

    until: datetime
    outage: ProviderHealth | None
    """The open breaker holding the call; None when only a Retry-After does."""


GO = Go()
PROBE = Probe()


def verdict(health: ProviderHealth | None, *, now: datetime) -> Go | Probe | Hold:
    """Whether a call to this provider may go out now."""
    if health is None:
        return GO
    if probe_due(health, now=now):
        return PROBE
    waits_for = [
        moment
        for moment in (
            health.not_before,
            health.next_probe_at if health.state is BreakerState.OPEN else None,
            health.probe_expires_at if health.state is BreakerState.HALF_OPEN else None,
        )
        if moment is not None and moment > now
    ]
    if health.state is BreakerState.CLOSED:
        if not waits_for:
            return GO
        return Hold(max(waits_for), None)
    return Hold(max(waits_for, default=now), health)


def _later(moment: datetime, other: datetime | None) -> datetime:
    return moment if other is None else max(moment, other)
