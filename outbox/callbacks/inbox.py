"""Receiving provider callbacks: verify, read, record (docs/design.md section 5,
"Callbacks").

A :class:`CallbackReceiver` holds, for every provider a registry's contracts declare,
the verifier its secrets make, and the body limit. :func:`record_callback` (and its async
twin) is what a web app of the user's calls from its own route, with the raw body and
the headers; ``outbox callbacks serve`` calls it too:

1. the body is at most ``max_body`` bytes (refused ``too_large``);
2. its signature verifies with one of the provider's secrets, inside the replay window
   (refused ``signature`` or ``timestamp``);
3. it is a JSON object the provider's ``read`` turns into a report whose values are
   within the inbox's bounds (refused ``malformed``), or into None: an event about no
   effect, answered 2xx and ``ignored``;
4. it is recorded once by (provider, event id), with the SHA-256 of the body, through
   the callbacks role's one database function: ``recorded``, ``duplicate`` or
   ``unmatched``. Nothing else happens here: the consumer's reconciler, which holds the
   contracts, applies it.

A refused callback raises :class:`~outbox.errors.CallbackRefused`, whose reason is a
metric label; nothing of the headers or the body is ever in a message or a log line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox import store
from outbox.bounds import (
    CALLBACK_EVENT_ID,
    CONTROL_CHARACTER,
    MAX_PROVIDER_REFERENCE,
    is_unreadable,
    load,
)
from outbox.callback_policy import CallbackProvider, CallbackReport
from outbox.callbacks.verify import (
    MAX_TOLERANCE_SECONDS,
    SECRETS_ENV,
    SECRETS_FILE_ENV,
    Verifier,
    secrets_from_environment,
    verifier_for,
)
from outbox.contracts import Registry
from outbox.errors import CallbackRefused, ConfigurationError
from outbox.store import AsyncConnection, AsyncStore, CallbackReceipt, Store, SyncConnection

# A provider's event is a few KiB; Stripe's largest are tens. The limit is what one
# request can make this process buffer before its signature is checked.
DEFAULT_MAX_BODY = 256 * 1024
# What a refused callback is answered with. A provider retries every 4xx and 5xx on its
# own schedule, so the status says what is wrong, for whoever reads its delivery log.
REFUSED_STATUS = {"signature": 400, "timestamp": 400, "too_large": 413, "malformed": 422}


@dataclass(frozen=True)
class Endpoint:
    """One provider as received: how its payloads read, and its verifier."""

    provider: CallbackProvider
    verifier: Verifier = field(repr=False)


class CallbackReceiver:
    """Every provider the registry's contracts declare, each with a verifier made from
    its secrets (by default ``OUTBOX_CALLBACK_SECRETS`` or the file
    ``OUTBOX_CALLBACK_SECRETS_FILE`` names). A declared provider without a secret, or a
    secret for a provider nothing declares (a typo), is refused here, before any route
    serves."""

    def __init__(
        self,
        registry: Registry,
        secrets: Mapping[str, Sequence[str]] | None = None,
        *,
        tolerance: float = MAX_TOLERANCE_SECONDS,
        max_body: int = DEFAULT_MAX_BODY,
    ) -> None:
        secrets = secrets_from_environment() if secrets is None else secrets
        providers = registry.callback_providers()
        if not providers:
            raise ConfigurationError(
                "no registered tool declares callbacks (ToolContract(callbacks=...)): there "
                "is no provider to receive them from"
            )
        unknown = sorted(set(secrets) - set(providers))
        if unknown:
            raise ConfigurationError(
                f"secrets are configured for {', '.join(unknown)}, which no registered "
                f"contract declares (declared: {', '.join(sorted(providers))}); correct "
                f"{SECRETS_ENV} or {SECRETS_FILE_ENV}"
            )
        missing = sorted(set(providers) - set(secrets))
        if missing:
            raise ConfigurationError(
                f"no secret for the callbacks of {', '.join(missing)}: set "
                f"{SECRETS_ENV}=provider:secret[,...] or {SECRETS_FILE_ENV}"
            )
        if max_body < 1:
            raise ConfigurationError("the callback body limit must be at least 1 byte")
        self.max_body = max_body
        self.endpoints = {
            name: Endpoint(
                provider,
                verifier_for(
                    provider.scheme, secrets[name], tolerance=tolerance, where=f"provider {name}"
                ),
            )
            for name, provider in sorted(providers.items())
        }

    @property
    def providers(self) -> list[str]:
        return list(self.endpoints)

    def read(self, provider: str, body: bytes, headers: Mapping[str, str]) -> CallbackReport | None:
        """The verified callback's report (None: an event about no effect); raises
        :class:`CallbackRefused`."""
        endpoint = self.endpoints.get(provider)
        if endpoint is None:
            raise ConfigurationError(
                f"{provider!r} is no provider of this receiver (it serves: "
                f"{', '.join(self.providers)})"
            )
        if len(body) > self.max_body:
            raise CallbackRefused("too_large", f"the callback's body is over {self.max_body} bytes")
        delivery = endpoint.verifier.verify(body, headers)
        payload: Any = load(body)
        if not isinstance(payload, dict) or is_unreadable(payload):
            raise CallbackRefused("malformed", "the callback's body is not a JSON object")
        try:
            report = endpoint.provider.read(payload, delivery)
        except (ValueError, KeyError, TypeError) as failed:
            raise CallbackRefused(
                "malformed", f"the provider's reader refused the payload ({type(failed).__name__})"
            ) from None
        if report is not None:
            _check_bounds(report)
        return report


def _check_bounds(report: CallbackReport) -> None:
    """What the inbox's checks would refuse, refused first and named: the database's
    refusal would be a failed statement, and the provider would retry it forever."""
    if not isinstance(report.event_id, str) or not CALLBACK_EVENT_ID.fullmatch(report.event_id):
        raise CallbackRefused(
            "malformed", "the event id is not 1 to 255 printable characters without a space"
        )
    reference = report.provider_reference
    if reference is not None and (
        not 1 <= len(reference) <= MAX_PROVIDER_REFERENCE or CONTROL_CHARACTER.search(reference)
    ):
        raise CallbackRefused(
            "malformed",
            f"the provider reference is not 1 to {MAX_PROVIDER_REFERENCE} characters "
            "without control characters",
        )


@dataclass(frozen=True)
class Received:
    """What receiving one callback came to: ``ignored`` (an event about no effect,
    nothing recorded) or the inbox's receipt."""

    report: CallbackReport | None
    receipt: CallbackReceipt | None

    @property
    def result(self) -> str:
        return "ignored" if self.receipt is None else self.receipt.result


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def record_callback(
    connection: SyncConnection,
    receiver: CallbackReceiver,
    provider: str,
    body: bytes,
    headers: Mapping[str, str],
) -> Received:
    """Verify, read and record one callback on ``connection`` (a psycopg 3 or SQLAlchemy
    connection, in a transaction or in autocommit). Commit soon: the recording holds a
    share lock on the operation's row until the transaction ends. Answer the provider
    2xx for every result; :class:`CallbackRefused` is a 4xx (413 for ``too_large``)."""
    report = receiver.read(provider, body, headers)
    if report is None:
        return Received(None, None)
    runner = Store(connection, require_transaction=False)
    return Received(report, runner.run(store.record_callback(provider, report, digest(body))))


async def record_callback_async(
    connection: AsyncConnection,
    receiver: CallbackReceiver,
    provider: str,
    body: bytes,
    headers: Mapping[str, str],
) -> Received:
    """The async twin of :func:`record_callback`."""
    report = receiver.read(provider, body, headers)
    if report is None:
        return Received(None, None)
    runner = await AsyncStore.on(connection, require_transaction=False)
    receipt = await runner.run(store.record_callback(provider, report, digest(body)))
    return Received(report, receipt)
