"""What a tool tells the runtime about an attempt or a lookup.

``execute`` returns :class:`EffectResult` when the provider confirmed the effect, and
otherwise raises one of the three signals, which decide what the runtime may do next:

- :class:`DefinitiveRejection`: the provider said no; the effect did not and will not
  happen. The operation ends ``rejected``.
- :class:`NotSent`: the failure is proven to have happened before the request left
  (connection refused, DNS failure). Safe to try again within the retry budget.
- :class:`OutcomeUnknown`: anything else. The effect may have happened; the runtime
  reconciles before it even considers another attempt.

An exception that is none of these is treated as :class:`OutcomeUnknown`: a runtime
that cannot tell must assume the effect may have happened.

``reconcile`` returns :class:`Found`, :class:`NotFound` or :class:`StillUnknown`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
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


class EffectSignal(OutboxError):
    """A tool's verdict on one attempt."""

    def __init__(self, code: str) -> None:
        self.code = _checked_code(code)
        super().__init__(f"{type(self).__name__}: {self.code}")


class DefinitiveRejection(EffectSignal):
    """The provider refused the request for good; the effect did not happen."""


class NotSent(EffectSignal):
    """The request provably never reached the provider."""


class OutcomeUnknown(EffectSignal):
    """The request may have reached the provider; its outcome was not observed."""


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


Reconciliation = Found | NotFound | StillUnknown


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
