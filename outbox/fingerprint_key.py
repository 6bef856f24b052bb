"""The short fingerprint that logs, events and spans show: keyed, so that a reader of
the logs cannot confirm a guessed input.

The full SHA-256 fingerprint stays in ``operations`` (the consumer and approvals need it).
Anywhere else an operation's intent is identified by the first 12 hex digits of
HMAC-SHA-256 over the full fingerprint, with a per-deployment key: without the key, a
log reader who guesses a low-entropy input (an amount, an account number) cannot
compute what its line would show. The key is ``OUTBOX_FINGERPRINT_KEY`` when set (the
same value in every process of a deployment), otherwise the one ``outbox migrate``
created in the database's ``outbox_deployment`` table.
"""

from __future__ import annotations

import hashlib
import hmac
import os

ENVIRONMENT_VARIABLE = "OUTBOX_FINGERPRINT_KEY"
SHORT_LENGTH = 12


def keyed_fingerprint(key: str, fingerprint: str) -> str:
    """The first 12 hex digits of HMAC-SHA-256(key, fingerprint)."""
    digest = hmac.new(key.encode(), fingerprint.encode(), hashlib.sha256).hexdigest()
    return digest[:SHORT_LENGTH]


def key_from_environment() -> str | None:
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    return value or None
