"""What a tool tells the runtime about an attempt or a lookup.

``execute`` returns :class:`EffectResult` when the provider confirmed the effect, and
otherwise raises one of the three signals, which decide what the runtime may do next:

- :class:`DefinitiveRejection`: the provider said no; the effect did not and will not
  happen. The operation ends ``rejected``.
- :class:`NotSent`: the failure is proven to have happened before the request left
  (connection refused, DNS failure). Safe to try again within the retry budget.
- :class:`OutcomeUnknown`: anything else. The effect may have happened; the runtime
  reconciles before it even considers another attempt.

Three more say the provider could not take the request now, so nothing happened and
nothing is spent: the operation waits for its provider (docs/contracts.md, "When the
provider is down"), never for a person until the contract's ``outage_tolerance`` runs
out.

- :class:`ProviderUnavailable`: the provider could not be reached, or answered that it
  cannot serve (a 503 that processed nothing). It counts toward the provider's breaker.
- :class:`RateLimited`: the provider asked us to slow down (429); its ``Retry-After``
  holds back every consumer's calls to that provider.
- :class:`InProgress`: the provider is still working on a request with this
  operation's key (409 "same key in flight"). The effect may happen, so for a
  non-repeatable write it is an unknown outcome; for the other classes the same key is
  sent again later, costing no attempt.

Any signal may carry the provider's ``Retry-After`` (``retry_after=``); no call to that
provider is made before it expires.

An exception that is none of these is treated as :class:`OutcomeUnknown`: a runtime
that cannot tell must assume the effect may have happened.

``reconcile`` returns :class:`Found`, :class:`NotFound` or :class:`StillUnknown` when the
provider answered, and :class:`Unreachable` when it could not be asked: only answered
lookups count against ``reconcile_max_attempts``.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from uuid import UUID

from outbox.errors import OutboxError

_CODE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def _checked_code(code: str) -> str:
    # Codes become metric label values and event attributes: a closed, safe alphabet.
    if not _CODE.fullmatch(code):
        raise ValueError(
            f"outcome code must match {_CODE.pattern} (it is used as a metric label); "
            "put details in logs of your own, not in the code"
        )
    return code


# A Retry-After longer than this is read as this: a provider's header is a request, and
# one that asks for a day would otherwise park every operation of that provider for it.
LONGEST_RETRY_AFTER = timedelta(hours=1)


def checked_retry_after(retry_after: timedelta | float | None) -> timedelta | None:
    """``retry_after`` (a timedelta or seconds) as a timedelta between 0 and
    :data:`LONGEST_RETRY_AFTER`; None stays None."""
    if retry_after is None:
        return None
    if isinstance(retry_after, bool) or not isinstance(retry_after, timedelta | int | float):
        raise TypeError("retry_after must be a timedelta, a number of seconds or None")
    if isinstance(retry_after, timedelta):
        delay = retry_after
    elif not math.isfinite(retry_after):
        raise ValueError("retry_after must be a finite number of seconds")
    else:
        delay = timedelta(seconds=min(retry_after, LONGEST_RETRY_AFTER.total_seconds()))
    if delay < timedelta(0):
        raise ValueError("retry_after must not be negative")
    return min(delay, LONGEST_RETRY_AFTER)


class EffectSignal(OutboxError):
    """A tool's verdict on one attempt; ``retry_after``, the provider's ``Retry-After``
    when it gave one."""

    def __init__(self, code: str, *, retry_after: timedelta | float | None = None) -> None:
        self.code = _checked_code(code)
        self.retry_after = checked_retry_after(retry_after)
        super().__init__(f"{type(self).__name__}: {self.code}")


class DefinitiveRejection(EffectSignal):
    """The provider refused the request for good; the effect did not happen."""


class NotSent(EffectSignal):
    """The request provably never reached the provider."""


class OutcomeUnknown(EffectSignal):
    """The request may have reached the provider; its outcome was not observed."""


class ProviderUnavailable(EffectSignal):
    """The provider could not take the request: unreachable, refused, or answering that
    it cannot serve before processing anything. The effect did not happen; the attempt
    costs nothing and counts toward the provider's breaker. Raise it only where the
    provider cannot have acted; where it may have, raise :class:`OutcomeUnknown`."""

    def __init__(
        self, code: str = "provider_unavailable", *, retry_after: timedelta | float | None = None
    ) -> None:
        super().__init__(code, retry_after=retry_after)


class RateLimited(EffectSignal):
    """The provider refused the request to slow us down (429): the effect did not
    happen, the attempt costs nothing, and no consumer calls that provider again before
    ``retry_after`` (one second when the provider gave none)."""

    def __init__(
        self, code: str = "rate_limited", *, retry_after: timedelta | float | None = None
    ) -> None:
        super().__init__(code, retry_after=retry_after)


class InProgress(OutcomeUnknown):
    """The provider is still working on a request with this operation's idempotency key
    (409 "same key in flight"): it is not a failure, and the effect may yet happen."""

    def __init__(
        self, code: str = "key_in_flight", *, retry_after: timedelta | float | None = None
    ) -> None:
        super().__init__(code, retry_after=retry_after)


@dataclass(frozen=True)
class EffectResult:
    """The provider confirmed the effect."""

    provider_reference: str | None = None
    result: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Found:
    """Reconciliation found the effect at the provider."""

    provider_reference: str | None = None
    result: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NotFound:
    """Reconciliation proved the effect is definitively absent."""


@dataclass(frozen=True)
class StillUnknown:
    """The lookup could not decide (provider down, eventual consistency window)."""

    code: str = "lookup_inconclusive"

    def __post_init__(self) -> None:
        _checked_code(self.code)


@dataclass(frozen=True)
class Unreachable:
    """The lookup could not ask: the provider was unreachable, timed out before any
    answer, or answered 5xx or 429. It says nothing about the effect, costs none of the
    contract's lookups, and counts toward the provider's breaker."""

    code: str = "provider_unreachable"
    retry_after: timedelta | None = None
    """The provider's ``Retry-After``, when it gave one: no call before it expires."""

    def __post_init__(self) -> None:
        _checked_code(self.code)
        object.__setattr__(self, "retry_after", checked_retry_after(self.retry_after))


Reconciliation = Found | NotFound | StillUnknown | Unreachable


@dataclass(frozen=True)
class ExecutionContext:
    """What a tool gets besides its input, for one attempt or one lookup.

    ``idempotency_key`` is the operation id: the same for every attempt, every
    reconciliation and every approval of one operation.
    """

    operation_id: UUID
    attempt: int
    deadline: float
    """``time.monotonic()`` value after which the runtime cancels the call."""
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def idempotency_key(self) -> str:
        return str(self.operation_id)

    def remaining(self) -> float:
        """Seconds left before the deadline (never negative)."""
        return max(0.0, self.deadline - time.monotonic())
