"""The payment sandbox's webhooks: what it reports on its own, signed, after the fact.

Two providers, as real ones sign: ``sandbox-payments`` reports each refund it executes
(``refund.succeeded``, or ``refund.failed`` for a decline) with a ``Stripe-Signature``;
``sandbox-email`` reports each email it accepts (``email.delivered``) with Standard
Webhooks headers, naming the request by the ``X-Reference`` header the caller sent (as
SendGrid's custom args or Resend's tags do). The readers here turn a verified payload
into the :class:`~outbox.callback_policy.CallbackReport` the runtime keeps, and the
sandbox's example tools declare them in their contracts.

Delivery is at least once, as providers deliver: a webhook the receiver answers with a
5xx (or no answer) is sent again, up to :data:`ATTEMPTS` times; a 4xx ends it (a
receiver that refuses a signature will refuse it again). Faults, set like the others
(:class:`~outbox.sandbox.provider.Faults`): every n-th event dropped or sent twice, a
delay, a window of events sent newest first, a signature with a secret nobody holds, a
timestamp ten minutes old. Lowering the delay releases what it holds, as for responses.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import httpx

from outbox.callback_policy import CallbackProvider, CallbackReport, CallbackStatus, Scheme
from outbox.callbacks.verify import sign_standard_webhooks, sign_stripe

if TYPE_CHECKING:
    from outbox.sandbox.provider import Faults

logger = logging.getLogger("outbox.sandbox.provider")

ATTEMPTS = 5
FIRST_RETRY_SECONDS = 0.2
SEND_TIMEOUT_SECONDS = 10.0
# A stale webhook is signed this long ago: past any receiver's replay window.
STALE_SECONDS = 600

_REFUND_STATUSES = {
    "refund.succeeded": CallbackStatus.COMMITTED,
    "refund.failed": CallbackStatus.REJECTED,
    "refund.pending": CallbackStatus.PENDING,
}
_EMAIL_STATUSES = {
    "email.delivered": CallbackStatus.COMMITTED,
    "email.bounced": CallbackStatus.REJECTED,
    "email.sent": CallbackStatus.PENDING,
}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def read_refund_event(payload: Mapping[str, Any], delivery: str) -> CallbackReport | None:
    """A sandbox-payments event (Stripe's shape: the event id in the body, the refund in
    ``data.object``, which carries the idempotency key the refund was posted with)."""
    status = _REFUND_STATUSES.get(str(payload.get("type")))
    if status is None:
        return None
    event_id = _text(payload.get("id"))
    refund = payload["data"]["object"]
    if event_id is None or not isinstance(refund, Mapping):
        raise ValueError("a refund event needs an id and a refund object")
    return CallbackReport.for_key(
        event_id, status, _text(refund.get("idempotency_key")), _text(refund.get("id"))
    )


def read_email_event(payload: Mapping[str, Any], delivery: str) -> CallbackReport | None:
    """A sandbox-email event (Standard Webhooks: the message id is the event's identity;
    ``data.reference`` is what the sender passed as ``X-Reference``)."""
    status = _EMAIL_STATUSES.get(str(payload.get("type")))
    if status is None:
        return None
    data = payload["data"]
    if not isinstance(data, Mapping):
        raise ValueError("an email event needs a data object")
    return CallbackReport.for_key(
        delivery, status, _text(data.get("reference")), _text(data.get("email_id"))
    )


PAYMENTS = CallbackProvider(name="sandbox-payments", scheme=Scheme.STRIPE, read=read_refund_event)
EMAIL = CallbackProvider(
    name="sandbox-email", scheme=Scheme.STANDARD_WEBHOOKS, read=read_email_event
)


def refund_event(kind: str, refund: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """A payments event and its delivery id (the event id: Stripe sends no other)."""
    event_id = f"evt_{secrets.token_hex(12)}"
    payload = {
        "id": event_id,
        "object": "event",
        "type": kind,
        "created": int(time.time()),
        "data": {"object": dict(refund)},
    }
    return payload, event_id


def email_event(kind: str, email_id: str, reference: str | None) -> tuple[dict[str, Any], str]:
    """An email event and its Standard Webhooks message id. Nothing of the recipient or
    the text: a receiver needs neither to know which effect it reports."""
    data: dict[str, Any] = {"email_id": email_id}
    if reference is not None:
        data["reference"] = reference
    payload = {
        "type": kind,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "data": data,
    }
    return payload, f"msg_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class WebhookTarget:
    """Where the sandbox sends its webhooks (``<url>/callbacks/<provider>``, the routes
    of ``outbox callbacks serve``) and the secrets it signs with, per provider."""

    url: str
    secrets: Mapping[str, tuple[str, ...]] = field(repr=False)


@dataclass(frozen=True)
class _Event:
    provider: CallbackProvider
    payload: dict[str, Any]
    delivery: str
    forged: bool = False
    stale: bool = False


@dataclass
class _Delivery:
    event: _Event
    queued: float


class WebhookSender:
    """Sends the sandbox's webhooks from a thread of its own. :meth:`emit` only queues
    (it is called with the books locked); faults are decided there, delays and sending
    happen on the thread. It never takes the books' lock: the books call it, not the
    other way round."""

    def __init__(self, faults: Faults) -> None:
        self._faults = faults
        self._target: WebhookTarget | None = None
        self._changed = threading.Condition()
        self._queue: deque[_Delivery] = deque()
        self._held: list[_Event] = []
        self._counters: dict[str, int] = {}
        self._log: list[dict[str, Any]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def target(self) -> WebhookTarget | None:
        return self._target

    def configure(self, target: WebhookTarget | None) -> None:
        with self._changed:
            self._target = target
            self._changed.notify_all()

    def update(self, faults: Faults, changed: set[str]) -> None:
        """New faults: a changed ``*_every`` counts from one again; a lower delay
        releases what waits."""
        with self._changed:
            self._faults = faults
            for name in changed:
                self._counters.pop(name.removesuffix("_every"), None)
            if not faults.webhook_reorder and self._held:
                self._release()
            self._changed.notify_all()

    def emit(self, provider: CallbackProvider, payload: dict[str, Any], delivery: str) -> None:
        with self._changed:
            if self._target is None:
                return
            faults = self._faults
            if self._hits("webhook_drop", faults.webhook_drop_every):
                self._note(provider, payload, delivery, "dropped")
                return
            event = _Event(
                provider,
                payload,
                delivery,
                forged=self._hits("webhook_forge", faults.webhook_forge_every),
                stale=self._hits("webhook_stale", faults.webhook_stale_every),
            )
            copies = 2 if self._hits("webhook_duplicate", faults.webhook_duplicate_every) else 1
            self._held.extend([event] * copies)
            if len(self._held) >= faults.webhook_reorder:
                self._release()
            self._changed.notify_all()

    def _release(self) -> None:
        # Newest first when a window was held: a receiver must cope with any order.
        events = reversed(self._held) if self._faults.webhook_reorder else self._held
        now = time.monotonic()
        self._queue.extend(_Delivery(event, now) for event in events)
        self._held = []

    def _hits(self, fault: str, every: int) -> bool:
        if every <= 0:
            return False
        count = self._counters.get(fault, 0) + 1
        self._counters[fault] = count
        return count % every == 0

    def waiting(self) -> int:
        with self._changed:
            return len(self._queue) + len(self._held)

    def log(self) -> list[dict[str, Any]]:
        with self._changed:
            return [dict(entry) for entry in self._log]

    def reset(self) -> None:
        with self._changed:
            self._queue.clear()
            self._held = []
            self._counters.clear()
            self._log.clear()

    def start(self) -> None:
        with self._changed:
            self._stopping = False
        self._thread = threading.Thread(target=self._run, name="sandbox-webhooks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._changed:
                delivery = self._next()
                if delivery is None:
                    return
                target = self._target
            if target is not None:
                self._send(target, delivery.event)

    def _next(self) -> _Delivery | None:
        """The next delivery once its delay is over (the lock held); None when stopping."""
        while not self._stopping:
            if self._queue:
                due = self._queue[0].queued + self._faults.webhook_delay_ms / 1000
                left = due - time.monotonic()
                if left <= 0:
                    return self._queue.popleft()
                self._changed.wait(left)
            else:
                self._changed.wait()
        return None

    def _send(self, target: WebhookTarget, event: _Event) -> None:
        body = json.dumps(event.payload).encode()
        url = f"{target.url.rstrip('/')}/callbacks/{event.provider.name}"
        wait = FIRST_RETRY_SECONDS
        for attempt in range(1, ATTEMPTS + 1):
            headers = self._signed(target, event, body)
            try:
                status: int | str = httpx.post(
                    url, content=body, headers=headers, timeout=SEND_TIMEOUT_SECONDS
                ).status_code
            except httpx.HTTPError as failed:
                status = type(failed).__name__
            with self._changed:
                self._note(event.provider, event.payload, event.delivery, status, attempt)
                if isinstance(status, int) and status < 500:
                    return
                if attempt == ATTEMPTS or self._changed.wait_for(lambda: self._stopping, wait):
                    return
            wait *= 2

    @staticmethod
    def _signed(target: WebhookTarget, event: _Event, body: bytes) -> dict[str, str]:
        keys = target.secrets.get(event.provider.name, ())
        if event.forged or not keys:
            # A secret of nobody's, in the provider's own format.
            keys = ("whsec_" + secrets.token_urlsafe(32).replace("-", "a").replace("_", "b"),)
        when = time.time() - (STALE_SECONDS if event.stale else 0)
        if event.provider.scheme is Scheme.STRIPE:
            headers = sign_stripe(keys, body, when)
        else:
            headers = sign_standard_webhooks(keys, event.delivery, body, when)
        return {**headers, "Content-Type": "application/json"}

    def _note(
        self,
        provider: CallbackProvider,
        payload: Mapping[str, Any],
        delivery: str,
        status: int | str,
        attempt: int = 0,
    ) -> None:
        entry = {
            "provider": provider.name,
            "type": payload.get("type"),
            "delivery": delivery,
            "status": status,
            "attempt": attempt,
        }
        self._log.append(entry)
        logger.info(
            "provider.webhook.sent provider=%s type=%s status=%s attempt=%d",
            provider.name,
            payload.get("type"),
            status,
            attempt,
            extra={"action": "provider.webhook.sent"},
        )
