"""Provider callbacks (signed webhooks) as evidence, shaped like ``outbox.console`` and
``outbox.mcp``: ``verify`` checks a signature and reads what a provider reported,
``inbox`` records it once by its event id (``record_callback``, for a web app of your
own), ``server`` is ``outbox callbacks serve``, and ``cli`` the command group. The
consumer applies what is recorded (docs/callbacks.md)."""

from __future__ import annotations

from outbox.callbacks.inbox import (
    DEFAULT_MAX_BODY,
    REFUSED_STATUS,
    CallbackReceiver,
    Endpoint,
    Received,
    digest,
    record_callback,
    record_callback_async,
)

__all__ = [
    "DEFAULT_MAX_BODY",
    "REFUSED_STATUS",
    "CallbackReceiver",
    "Endpoint",
    "Received",
    "digest",
    "record_callback",
    "record_callback_async",
]
