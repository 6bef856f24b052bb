"""What a tool's contract says about its provider's callbacks (docs/design.md section 5,
"Callbacks").

A provider reports many effects on its own, later, in signed webhooks. A contract names
the :class:`CallbackProvider` whose webhooks concern it (the route they arrive on, how
they are signed, how a verified payload reads as a :class:`CallbackReport`) and, in its
:class:`CallbackPolicy`, how much that provider's word may do: settle an unknown outcome
or only be evidence for a person, prove an effect absent or not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any
from uuid import UUID

# A provider name is a route segment (/callbacks/<name>) and a metric label value.
PROVIDER_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


class CallbackStatus(StrEnum):
    """What a callback reports about the effect it names."""

    COMMITTED = "committed"
    """The effect happened."""
    REJECTED = "rejected"
    """The effect failed, or was refused."""
    PENDING = "pending"
    """Still under way: says nothing final."""


class Scheme(StrEnum):
    """How a provider signs its webhooks."""

    STANDARD_WEBHOOKS = "standard_webhooks"
    """webhook-id, webhook-timestamp, webhook-signature (standardwebhooks.com)."""
    STRIPE = "stripe"
    """Stripe-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of "<t>.<body>">."""


@dataclass(frozen=True)
class CallbackReport:
    """A verified payload, read: which event, what it says, which effect it is about."""

    event_id: str
    """The provider's id of this event: a redelivery carries the same one."""
    status: CallbackStatus
    operation_id: UUID | None = None
    """The operation it names (the idempotency key the tool sent), when it names one."""
    provider_reference: str | None = None
    """The provider's id of the effect (a refund id, a message id)."""

    @classmethod
    def for_key(
        cls,
        event_id: str,
        status: CallbackStatus | str,
        idempotency_key: str | None,
        provider_reference: str | None = None,
    ) -> CallbackReport:
        """A report that names its operation by the idempotency key the tool sent (the
        operation id). A key that is no operation id names none: the callback is then
        matched by its provider reference, or kept as unmatched."""
        operation_id: UUID | None = None
        if idempotency_key:
            try:
                operation_id = UUID(idempotency_key)
            except ValueError:
                operation_id = None
        return cls(
            event_id=event_id,
            status=CallbackStatus(status),
            operation_id=operation_id,
            provider_reference=provider_reference,
        )


ReadPayload = Callable[[Mapping[str, Any], str], CallbackReport | None]
"""A verified JSON payload and its delivery id (Standard Webhooks' ``webhook-id``, the
same on every retry of one message; "" for a scheme that sends none, such as Stripe's,
whose event id is in the payload) -> its report, or None for an event that reports no
effect (answered 2xx and counted as ignored). Raising ``ValueError``, ``KeyError`` or
``TypeError`` refuses it as malformed."""


@dataclass(frozen=True)
class CallbackProvider:
    """One provider's webhook endpoint: its name (the route ``/callbacks/<name>``, and
    the name its secrets are configured under), its signature scheme, and how its
    verified payloads read."""

    name: str
    scheme: Scheme
    read: ReadPayload = field(repr=False)


@dataclass(frozen=True)
class CallbackPolicy:
    """How much a tool lets its provider's verified callbacks do."""

    provider: CallbackProvider
    settles_unknown: bool = False
    """A success callback for an unknown outcome commits it (``operation.reconciled
    method=callback``); otherwise it is evidence for a person."""
    failure_definitive: bool = False
    """A failure callback for an unknown outcome proves the effect absent, as a lookup's
    ``NotFound`` does, and so authorises another attempt; otherwise it is evidence."""
    wait: timedelta = timedelta(0)
    """How long an unknown outcome of a tool without a lookup waits for a callback before
    the contract's next step (a retry, or a person). A lookup never waits."""


def policy_problems(policy: object, *, read_only: bool) -> list[str]:
    """What makes a contract's ``callbacks=`` unusable, in words that say the fix."""
    if not isinstance(policy, CallbackPolicy):
        return ["callbacks must be a CallbackPolicy (or None)"]
    problems: list[str] = []
    provider = policy.provider
    if not isinstance(provider, CallbackProvider):
        problems.append("callbacks.provider must be a CallbackProvider")
    else:
        if not isinstance(provider.name, str) or not PROVIDER_NAME.fullmatch(provider.name):
            problems.append(
                f"callback provider name must match {PROVIDER_NAME.pattern} (it is a route "
                "segment and a metric label)"
            )
        if not isinstance(provider.scheme, Scheme):
            problems.append(f"callback provider scheme must be one of {[s.value for s in Scheme]}")
        if not callable(provider.read):
            problems.append("callback provider read must be callable")
    if read_only:
        problems.append("callbacks on a read_only tool: it has no effect for a provider to report")
    if not isinstance(policy.wait, timedelta) or policy.wait < timedelta(0):
        problems.append("callbacks.wait must not be negative")
    return problems
