"""Verifying a provider's signed callbacks, and where their secrets come from.

Two schemes of one small protocol (an HMAC-SHA256 over a timestamp and the body, a
tolerance on the timestamp, several signatures so a secret can be rotated):

- **Standard Webhooks** (standardwebhooks.com: Svix, Resend, Clerk and others), through
  the maintained ``standardwebhooks`` package. Its own timestamp check is fixed at 5
  minutes, so a receiver may demand less (:data:`MAX_TOLERANCE_SECONDS`), never more;
  and its parser raises plain ``ValueError`` on some malformed headers, which is
  refused here like any bad signature.
- **Stripe's** ``Stripe-Signature: t=<unix time>,v1=<hex>[,v1=<hex>...]``, implemented
  here with :func:`hmac.compare_digest` exactly as Stripe's libraries compute it (HMAC
  of ``"<t>.<body>"`` keyed by the endpoint secret as text; ``v0`` and other schemes are
  ignored), and checked against the ``stripe`` package in the tests. Unlike Stripe's own
  check it also refuses a timestamp from the future: a replay window that never closes.

A refused callback raises :class:`~outbox.errors.CallbackRefused` with a reason from
:data:`REFUSED_REASONS`, never the header's or the body's content. Secrets come from
``OUTBOX_CALLBACK_SECRETS`` (``provider:secret[,provider:secret...]``, one provider
repeated for a rotation) or the file ``OUTBOX_CALLBACK_SECRETS_FILE`` names (one entry
a line): never from a flag, which ``ps`` shows to every user, and never in a log.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import standardwebhooks

from outbox.callback_policy import PROVIDER_NAME, Scheme
from outbox.credentials import parse_credentials
from outbox.errors import CallbackRefused, ConfigurationError

SECRETS_ENV = "OUTBOX_CALLBACK_SECRETS"
SECRETS_FILE_ENV = "OUTBOX_CALLBACK_SECRETS_FILE"
# standardwebhooks refuses a timestamp more than 5 minutes away on its own; Stripe's
# libraries default to the same.
MAX_TOLERANCE_SECONDS = 300.0
MIN_SECRET_LENGTH = 16
# What a refused callback is counted as (a metric label): a signature that does not
# verify (forged, another secret, a malformed header), a timestamp outside the replay
# window, a body over the limit, or one that is no JSON a provider could have signed.
REFUSED_REASONS = ("signature", "timestamp", "too_large", "malformed")

# Both schemes send whole seconds; twelve digits reach the year 33658.
_SECONDS = re.compile(r"^[0-9]{1,12}$")
_HEX_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Verifier(Protocol):
    def verify(self, body: bytes, headers: Mapping[str, str]) -> str:
        """Returns the delivery's id when the scheme sends one (else ""); raises
        :class:`CallbackRefused`."""


def _lowered(headers: Mapping[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def _check_tolerance(tolerance: float) -> None:
    if not (math.isfinite(tolerance) and 0 < tolerance <= MAX_TOLERANCE_SECONDS):
        raise ConfigurationError(
            f"a callback's timestamp tolerance must be above 0 and at most "
            f"{MAX_TOLERANCE_SECONDS:g} s (standardwebhooks checks 5 minutes itself)"
        )


def _timestamp(text: str | None, tolerance: float) -> int:
    """The header's timestamp, if it is whole seconds within ``tolerance`` of now."""
    if text is None or not _SECONDS.fullmatch(text):
        raise CallbackRefused("timestamp", "the callback's timestamp is not whole seconds")
    seconds = int(text)
    if abs(time.time() - seconds) > tolerance:
        raise CallbackRefused("timestamp", "the callback's timestamp is outside the window")
    return seconds


@dataclass(frozen=True)
class StandardWebhooksVerifier:
    """webhook-id, webhook-timestamp and webhook-signature, checked by ``standardwebhooks``
    against every configured secret (the old and the new one, while rotating)."""

    secrets: tuple[str, ...] = field(repr=False)
    tolerance: float = MAX_TOLERANCE_SECONDS
    where: str = "this provider"
    _webhooks: tuple[standardwebhooks.Webhook, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_tolerance(self.tolerance)
        webhooks = []
        for number, secret in enumerate(self.secrets, start=1):
            try:
                webhooks.append(standardwebhooks.Webhook(secret))
            except Exception as error:
                # Never the secret itself, nor the library's text (it may quote it).
                raise ConfigurationError(
                    f"secret {number} of {self.where} is not a Standard Webhooks secret "
                    f"(whsec_ and base64): {type(error).__name__}"
                ) from None
        if not webhooks:
            raise ConfigurationError(f"{self.where} has no secret to verify its callbacks with")
        object.__setattr__(self, "_webhooks", tuple(webhooks))

    def verify(self, body: bytes, headers: Mapping[str, str]) -> str:
        given = _lowered(headers)
        delivery = given.get("webhook-id")
        if not delivery or not given.get("webhook-signature"):
            raise CallbackRefused("signature", "a Standard Webhooks header is missing")
        _timestamp(given.get("webhook-timestamp"), self.tolerance)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise CallbackRefused("malformed", "the callback's body is not UTF-8") from None
        for webhook in self._webhooks:
            try:
                webhook.verify(text, given, json_parse=False)
            except standardwebhooks.WebhookVerificationError as failed:
                if "timestamp" in str(failed).lower():
                    # Our own window is the library's or shorter: only a clock tick at
                    # its edge gets here.
                    raise CallbackRefused("timestamp") from None
                continue
            except (ValueError, binascii.Error):
                # "v1" without a comma, or a signature that is no base64: the library
                # raises these instead of its own error.
                raise CallbackRefused("signature", "the signature header is malformed") from None
            return delivery
        raise CallbackRefused("signature", "no configured secret verifies the callback")


@dataclass(frozen=True)
class StripeVerifier:
    """``Stripe-Signature: t=…,v1=…``: a v1 signature that matches one configured secret,
    with a timestamp inside the window on either side of now."""

    secrets: tuple[str, ...] = field(repr=False)
    tolerance: float = MAX_TOLERANCE_SECONDS
    where: str = "this provider"

    def __post_init__(self) -> None:
        _check_tolerance(self.tolerance)
        if not self.secrets or not all(self.secrets):
            raise ConfigurationError(f"{self.where} has no secret to verify its callbacks with")

    def verify(self, body: bytes, headers: Mapping[str, str]) -> str:
        header = _lowered(headers).get("stripe-signature")
        if not header:
            raise CallbackRefused("signature", "the Stripe-Signature header is missing")
        stamps: list[str] = []
        signatures: list[str] = []
        for item in header.split(","):
            key, equals, value = item.strip().partition("=")
            if not equals:
                raise CallbackRefused("signature", "the signature header is malformed")
            if key == "t":
                stamps.append(value)
            elif key == "v1":
                signatures.append(value)
        if len(stamps) != 1 or not signatures:
            raise CallbackRefused("signature", "the signature header is malformed")
        seconds = _timestamp(stamps[0], self.tolerance)
        # As Stripe's libraries sign: the integer's text, a dot, the body as sent.
        signed = f"{seconds}.".encode() + body
        found = False
        for secret in self.secrets:
            expected = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest().encode()
            for signature in signatures:
                # compare_digest refuses text that is not ASCII: only a hex digest can
                # match anyway, so anything else is skipped unread.
                if _HEX_SHA256.fullmatch(signature) and hmac.compare_digest(
                    expected, signature.encode()
                ):
                    found = True
        if not found:
            raise CallbackRefused("signature", "no configured secret verifies the callback")
        return ""


def verifier_for(
    scheme: Scheme,
    secrets: Sequence[str],
    *,
    tolerance: float = MAX_TOLERANCE_SECONDS,
    where: str = "this provider",
) -> StandardWebhooksVerifier | StripeVerifier:
    if scheme is Scheme.STANDARD_WEBHOOKS:
        return StandardWebhooksVerifier(tuple(secrets), tolerance, where)
    return StripeVerifier(tuple(secrets), tolerance, where)


def sign_standard_webhooks(
    secrets: Sequence[str], delivery: str, body: bytes, timestamp: float
) -> dict[str, str]:
    """The headers a Standard Webhooks sender sends, signed with each secret (the
    sandbox's side, and the tests')."""
    moment = datetime.fromtimestamp(int(timestamp), tz=UTC)
    signatures = [
        standardwebhooks.Webhook(secret).sign(delivery, moment, body.decode("utf-8"))
        for secret in secrets
    ]
    return {
        "webhook-id": delivery,
        "webhook-timestamp": str(int(timestamp)),
        "webhook-signature": " ".join(signatures),
    }


def sign_stripe(secrets: Sequence[str], body: bytes, timestamp: float) -> dict[str, str]:
    """The ``Stripe-Signature`` header, one v1 signature per secret, as Stripe sends it
    while an endpoint has two secrets."""
    seconds = int(timestamp)
    signed = f"{seconds}.".encode() + body
    signatures = ",".join(
        "v1=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest() for secret in secrets
    )
    return {"Stripe-Signature": f"t={seconds},{signatures}"}


def _provider_name(text: str) -> str:
    if not PROVIDER_NAME.fullmatch(text):
        raise ConfigurationError(f"a provider name must match {PROVIDER_NAME.pattern}")
    return text


def secrets_from_environment(
    environ: Mapping[str, str] | None = None,
) -> dict[str, tuple[str, ...]]:
    """Every provider's secrets, in the order given (a rotation lists the old and the
    new). Errors name the variable and the entry's position, never its content."""
    environ = os.environ if environ is None else environ
    text = environ.get(SECRETS_ENV, "")
    path = environ.get(SECRETS_FILE_ENV, "")
    if text and path:
        raise ConfigurationError(
            f"set one of {SECRETS_ENV} and {SECRETS_FILE_ENV}, not both: which one would "
            "hold the secrets in force could not be told"
        )
    variable = SECRETS_ENV
    if path:
        variable = SECRETS_FILE_ENV
        try:
            with open(path, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigurationError(
                f"cannot read {SECRETS_FILE_ENV}: {getattr(error, 'strerror', None) or error}"
            ) from None
        entries = []
        for number, line in enumerate(lines, start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if "," in line:
                raise ConfigurationError(f"{SECRETS_FILE_ENV} line {number} holds a comma")
            entries.append(line.strip())
        text = ",".join(entries)
    found: dict[str, list[str]] = {}
    for credential in parse_credentials(
        text,
        variable=variable,
        min_length=MIN_SECRET_LENGTH,
        name=_provider_name,
        kind="secret",
        hint=" (the provider issues it)",
    ):
        found.setdefault(credential.name, []).append(credential.token)
    return {name: tuple(secrets) for name, secrets in found.items()}
