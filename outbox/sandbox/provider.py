"""A payment-provider sandbox: refunds and emails over real HTTP, with injectable faults.

The runtime has to tell "the effect failed" from "we failed to observe it" (docs/design.md
section 1). A mock that raises exceptions cannot show that difference; this server can:
it commits a refund and then drops the connection, fails before committing, answers 409
while a key is executing, forgets idempotency keys as Stripe does after 24 h, turns its
lookup endpoint off, goes down altogether (503 to every call and lookup) and rate-limits
(429 with ``Retry-After``). ``GET /ledger`` is the evidence of how many effects happened;
``GET /admin/requests`` is when each call and lookup arrived and what it was answered, so
a test can tell whether a client honoured a ``Retry-After`` and how fast it came back.

Semantics other code relies on:

- While ``unavailable`` is on, every refund, email and lookup is answered 503
  ``service_unavailable`` before anything else is looked at (with ``Retry-After`` when
  ``unavailable_retry_after_s`` is set); nothing is committed, no counter moves.
- Refund requests pass, in order: the ``Idempotency-Key`` header (400), the body (400),
  the payment id's format (404), the rate limit (429, ``Retry-After:
  rate_limit_retry_after_s``), the fail-before-commit fault (503), the conflict fault
  (409), the idempotency layer (409 while the key executes, 422 for the same key with
  other parameters, a replay of the original status and body for the same key and
  parameters), then execution (402 when the amount exceeds what remains refundable,
  else 201). Failures before execution record nothing, so the key stays unused.
- An execution's result (201 or 402) is what later requests with its key replay, until
  ``prune_keys_older_than_s`` forgets the key. A lookup by key still finds the refund.
- ``delay_ms`` holds an execution's response with its key marked executing; lowering
  ``delay_ms`` (or stopping the server) releases requests already waiting, so tests
  never have to sit out a long delay.
- ``drop_response_*`` applies to executions and replays alike: the network loses a
  replay's response as easily as the first one.
- Emails pass the same faults after their body; lookups (by key and by id) the rate
  limit only, then ``lookups_unavailable`` (by key).
- "every n" counters count, per endpoint kind (refunds, emails, lookups) and per fault,
  the well-formed requests that reach that fault since its ``*_every`` field was last set.
- The request log keeps the last :data:`REQUEST_LOG_LIMIT` calls and lookups; ``reset``
  empties it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import secrets
import socket
import socketserver
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal, cast
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from outbox.bounds import CONTROL_CHARACTER
from outbox.sandbox.webhooks import (
    EMAIL,
    PAYMENTS,
    STALE_SECONDS,
    WebhookSender,
    WebhookTarget,
    email_event,
    refund_event,
)

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8600
DEFAULT_PAYMENT_AMOUNT_CENTS = 100_000
PAYMENT_ID = re.compile(r"pay_[A-Za-z0-9_]{1,60}")
MAX_KEY_LENGTH = 255
MAX_BODY_BYTES = 1 << 20
# A client that connects and never finishes its request must not hold stop() forever:
# stop() joins every handler thread.
REQUEST_READ_TIMEOUT = 5.0
# stop() waits up to one poll for the serving loop to notice; tests stop one per test.
SERVE_POLL_SECONDS = 0.02

# The request log keeps this many calls and lookups, the newest: enough for any test or
# chaos run, and a provider left running for days cannot grow without bound.
REQUEST_LOG_LIMIT = 100_000

Kind = Literal["refunds", "emails", "lookups"]
KINDS: tuple[Kind, ...] = ("refunds", "emails", "lookups")
FaultName = Literal["fail_before_commit", "conflict", "drop_response", "rate_limit"]
Json = dict[str, Any]

# The provider's API, as the request log names its endpoints; admin routes go unlogged.
CREATE_REFUND = "POST /refunds"
LOOKUP_REFUND = "GET /refunds?idempotency_key="
GET_REFUND = "GET /refunds/{id}"
SEND_EMAIL = "POST /emails"
ENDPOINTS = (CREATE_REFUND, LOOKUP_REFUND, GET_REFUND, SEND_EMAIL)


class Faults(BaseModel):
    """What the sandbox does wrong, and how often. All off by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(default=0, description="seed of the one RNG behind every probability")
    fail_before_commit_every: int = Field(
        default=0, ge=0, description="answer 503 to every n-th POST without committing"
    )
    fail_before_commit_probability: float = Field(
        default=0.0, ge=0.0, le=1.0, description="chance of a 503 without committing"
    )
    conflict_every: int = Field(
        default=0, ge=0, description="answer 409 request_in_progress to every n-th POST"
    )
    conflict_probability: float = Field(
        default=0.0, ge=0.0, le=1.0, description="chance of a 409 without committing"
    )
    delay_ms: int = Field(
        default=0, ge=0, description="hold each response this long after committing"
    )
    drop_response_every: int = Field(
        default=0, ge=0, description="commit, then close without a response, every n-th POST"
    )
    drop_response_probability: float = Field(
        default=0.0, ge=0.0, le=1.0, description="chance of committing and sending nothing"
    )
    prune_keys_older_than_s: float | None = Field(
        default=None, ge=0.0, description="forget idempotency keys this old (lookups still work)"
    )
    lookups_unavailable: bool = Field(
        default=False, description="answer 503 to GET /refunds?idempotency_key="
    )
    unavailable: bool = Field(
        default=False,
        description="an outage: answer 503 to every refund, email and lookup, committing nothing",
    )
    unavailable_retry_after_s: int | None = Field(
        default=None, ge=0, description="the outage's Retry-After, in seconds (none: no header)"
    )
    rate_limit_every: int = Field(
        default=0, ge=0, description="answer 429 to every n-th call or lookup, before committing"
    )
    rate_limit_probability: float = Field(
        default=0.0, ge=0.0, le=1.0, description="chance of a 429 before committing"
    )
    rate_limit_retry_after_s: int | None = Field(
        default=1, ge=0, description="the 429's Retry-After, in seconds (none: no header)"
    )
    # Webhooks (outbox.sandbox.webhooks): what the provider reports on its own, later.
    webhook_drop_every: int = Field(
        default=0, ge=0, description="send no webhook for every n-th event"
    )
    webhook_duplicate_every: int = Field(
        default=0, ge=0, description="send every n-th event's webhook twice"
    )
    webhook_delay_ms: int = Field(
        default=0, ge=0, description="hold each webhook this long before sending it"
    )
    webhook_reorder: int = Field(
        default=0,
        ge=0,
        description="hold webhooks until this many wait, then send them newest first",
    )
    webhook_forge_every: int = Field(
        default=0, ge=0, description="sign every n-th webhook with a secret nobody holds"
    )
    webhook_stale_every: int = Field(
        default=0,
        ge=0,
        description=f"sign every n-th webhook {STALE_SECONDS // 60} minutes in the past",
    )


class _RefundRequest(BaseModel):
    # Strict: a provider that took "100" or 1.5 as an amount would hide client bugs.
    model_config = ConfigDict(extra="forbid", strict=True)

    payment_id: str
    amount_cents: int = Field(gt=0)
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    reason: str = ""


class _EmailRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    to: str = Field(min_length=1)
    subject: str
    body: str


@dataclass(frozen=True)
class _Refund:
    id: str
    payment_id: str
    amount_cents: int
    currency: str
    idempotency_key: str

    def as_json(self) -> Json:
        return {
            "id": self.id,
            "status": "succeeded",
            "payment_id": self.payment_id,
            "amount_cents": self.amount_cents,
            "currency": self.currency,
            "idempotency_key": self.idempotency_key,
        }


@dataclass(frozen=True)
class _Email:
    id: str
    to: str
    subject: str
    reference: str | None = None


@dataclass(frozen=True)
class _Replay:
    params: tuple[str, int, str, str]
    status: int
    body: Json
    recorded_at: float


@dataclass(frozen=True)
class Reply:
    """What the server answers; ``drop`` means: send nothing and cut the connection."""

    status: int
    body: Json
    drop: bool = False
    started: float | None = None
    executing_key: str | None = None
    token: object = field(default=None, compare=False)
    headers: Mapping[str, str] = field(default_factory=dict)


def _seeded(seed: int) -> random.Random:
    # Reproducible on purpose: the same seed must replay the same faults. Nothing secret
    # comes from it (ids use secrets).
    return random.Random(seed)  # noqa: S311


def _error(status: int, code: str) -> Reply:
    return Reply(status, {"error": code})


def _refusal(status: int, code: str, retry_after_s: int | None) -> Reply:
    headers = {} if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return Reply(status, {"error": code}, headers=headers)


class SandboxState:
    """The provider's books. Every method is safe to call from any thread."""

    def __init__(self, payment_amount_cents: int, faults: Faults) -> None:
        if payment_amount_cents <= 0:
            raise ValueError("payment_amount_cents must be positive")
        self.payment_amount_cents = payment_amount_cents
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._faults = faults
        self._random = _seeded(faults.seed)
        self._stopping = False
        self._refunds: dict[str, _Refund] = {}
        self._refund_ids_by_key: dict[str, list[str]] = {}
        self._refunded_cents: dict[str, int] = {}
        self._replays: dict[str, _Replay] = {}
        self._executing: dict[str, object] = {}
        self._emails: list[_Email] = []
        self._counters: dict[tuple[Kind, FaultName], int] = {}
        self._requests: deque[Json] = deque(maxlen=REQUEST_LOG_LIMIT)
        self.webhooks = WebhookSender(faults)

    @property
    def faults(self) -> Faults:
        with self._lock:
            return self._faults

    def set_faults(self, **fields: Any) -> Faults:
        with self._changed:
            faults = Faults.model_validate({**self._faults.model_dump(), **fields})
            self._faults = faults
            if "seed" in fields:
                self._random = _seeded(faults.seed)
            for name in fields:
                if name.endswith("_every"):
                    fault = name.removesuffix("_every")
                    for kind in KINDS:
                        self._counters.pop((kind, cast(FaultName, fault)), None)
            # Requests held by a delay re-read delay_ms: a lower one releases them now.
            self._changed.notify_all()
            self.webhooks.update(faults, set(fields))
        logger.info(
            "provider.faults.set fields=%s",
            ",".join(sorted(fields)),
            extra={"action": "provider.faults.set"},
        )
        return faults

    def reset(self) -> None:
        with self._changed:
            self._refunds.clear()
            self._refund_ids_by_key.clear()
            self._refunded_cents.clear()
            self._replays.clear()
            self._executing.clear()
            self._emails.clear()
            self._counters.clear()
            self._requests.clear()
            self._random = _seeded(self._faults.seed)
            self._changed.notify_all()
            self.webhooks.reset()
        logger.info("provider.reset", extra={"action": "provider.reset"})

    def set_stopping(self, stopping: bool) -> None:
        with self._changed:
            self._stopping = stopping
            self._changed.notify_all()

    def executing_keys(self) -> list[str]:
        """Keys whose refund has committed but whose response is still held (``delay_ms``)."""
        with self._lock:
            return list(self._executing)

    def record_request(
        self, endpoint: str, arrived: float, arrived_at: float, reply: Reply
    ) -> None:
        """Log one call or lookup: when it arrived (``time.monotonic()`` and wall clock)
        and how it was answered."""
        retry_after = reply.headers.get("Retry-After")
        entry = {
            "endpoint": endpoint,
            "monotonic": arrived,
            "at": arrived_at,
            "status": reply.status,
            "retry_after_s": None if retry_after is None else int(retry_after),
            "dropped": reply.drop,
        }
        with self._lock:
            self._requests.append(entry)

    def requests(self, endpoint: str | None = None) -> list[Json]:
        """The logged calls and lookups (of ``endpoint`` only, if given), oldest first."""
        with self._lock:
            logged = [dict(entry) for entry in self._requests]
        # Handler threads log as they finish routing: arrival order may differ slightly.
        logged.sort(key=lambda entry: float(entry["monotonic"]))
        return [entry for entry in logged if endpoint is None or entry["endpoint"] == endpoint]

    def ledger(self) -> Json:
        with self._lock:
            refunds = list(self._refunds.values())
            by_payment: dict[str, int] = {}
            for refund in refunds:
                by_payment[refund.payment_id] = by_payment.get(refund.payment_id, 0) + 1
            return {
                "refunds": [refund.as_json() for refund in refunds],
                # Each email with the reference its sender passed (None without one), so
                # the ledger shows which decision sent which email, not only how many.
                "emails": [
                    {
                        "id": email.id,
                        "to": email.to,
                        "subject": email.subject,
                        "reference": email.reference,
                    }
                    for email in self._emails
                ],
                "refunds_by_payment": by_payment,
                "refunds_by_key": {key: len(ids) for key, ids in self._refund_ids_by_key.items()},
                # Emails take no key: the reference their sender passed (the operation id,
                # for the example tool) is what tells two sends of one decision apart.
                "emails_by_reference": dict(
                    Counter(email.reference for email in self._emails if email.reference)
                ),
                "totals": {"refunds": len(refunds), "emails": len(self._emails)},
            }

    def post_refund(self, key: str | None, raw: bytes) -> Reply:
        down = self._outage("refunds")
        if down is not None:
            return down
        if not key:
            return _error(400, "idempotency_key_required")
        if len(key) > MAX_KEY_LENGTH:
            return _error(400, "invalid_request")
        try:
            request = _RefundRequest.model_validate_json(raw)
        except ValidationError:
            return _error(400, "invalid_request")
        if not PAYMENT_ID.fullmatch(request.payment_id):
            return _error(404, "payment_not_found")
        params = (request.payment_id, request.amount_cents, request.currency, request.reason)
        with self._lock:
            refused = self._pre_commit_fault("refunds")
            if refused is not None:
                return refused
            if key in self._executing:
                return _error(409, "request_in_progress")
            replay = self._replays.get(key)
            if replay is not None and self._pruned(replay):
                del self._replays[key]
                replay = None
            if replay is not None:
                if replay.params != params:
                    return _error(422, "idempotency_key_reused")
                drop = self._hits("refunds", "drop_response")
                logger.info(
                    "provider.refund.replayed key=%s status=%d",
                    key,
                    replay.status,
                    extra={"action": "provider.refund.replayed"},
                )
                return Reply(replay.status, dict(replay.body), drop=drop)
            status, body = self._execute_refund(key, request)
            now = time.monotonic()
            self._replays[key] = _Replay(params, status, body, now)
            token = object()
            self._executing[key] = token
            drop = self._hits("refunds", "drop_response")
        return Reply(status, dict(body), drop=drop, started=now, executing_key=key, token=token)

    def post_email(self, raw: bytes, reference: str | None = None) -> Reply:
        down = self._outage("emails")
        if down is not None:
            return down
        try:
            request = _EmailRequest.model_validate_json(raw)
        except ValidationError:
            return _error(400, "invalid_request")
        if reference is not None and (
            not 1 <= len(reference) <= MAX_KEY_LENGTH or CONTROL_CHARACTER.search(reference)
        ):
            return _error(400, "invalid_request")
        with self._lock:
            refused = self._pre_commit_fault("emails")
            if refused is not None:
                return refused
            email = _Email(f"em_{secrets.token_hex(12)}", request.to, request.subject, reference)
            self._emails.append(email)
            self.webhooks.emit(EMAIL, *email_event("email.delivered", email.id, reference))
            drop = self._hits("emails", "drop_response")
            now = time.monotonic()
        logger.info(
            "provider.email.sent email=%s", email.id, extra={"action": "provider.email.sent"}
        )
        return Reply(202, {"id": email.id, "status": "sent"}, drop=drop, started=now)

    def finish(self, reply: Reply) -> None:
        """Hold an executed request for the current ``delay_ms``, then release its key."""
        if reply.started is None:
            return
        with self._changed:
            while not self._stopping:
                remaining = reply.started + self._faults.delay_ms / 1000 - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            # A reset in the meantime may have let a new request take the key: only the
            # request that marked it may unmark it.
            key = reply.executing_key
            if key is not None and self._executing.get(key) is reply.token:
                del self._executing[key]

    def lookup_by_key(self, key: str | None) -> Reply:
        """The refund of ``key`` (None or empty: the request named no single key)."""
        down = self._outage("lookups")
        if down is not None:
            return down
        if not key:
            return _error(400, "invalid_request")
        with self._lock:
            limited = self._rate_limited("lookups")
            if limited is not None:
                return limited
            if self._faults.lookups_unavailable:
                return _error(503, "lookups_unavailable")
            if key in self._executing:
                return _error(409, "request_in_progress")
            ids = self._refund_ids_by_key.get(key)
            if not ids:
                return _error(404, "not_found")
            # The first refund is the one the key was meant for; later ones are the
            # duplicates a replay after pruning created (refunds_by_key counts them).
            return Reply(200, self._refunds[ids[0]].as_json())

    def refund(self, refund_id: str) -> Reply:
        down = self._outage("lookups")
        if down is not None:
            return down
        with self._lock:
            limited = self._rate_limited("lookups")
            if limited is not None:
                return limited
            refund = self._refunds.get(refund_id)
            if refund is None:
                return _error(404, "not_found")
            return Reply(200, refund.as_json())

    def _execute_refund(self, key: str, request: _RefundRequest) -> tuple[int, Json]:
        refunded = self._refunded_cents.get(request.payment_id, 0)
        if request.amount_cents > self.payment_amount_cents - refunded:
            logger.info(
                "provider.refund.declined key=%s code=amount_exceeds_payment",
                key,
                extra={"action": "provider.refund.declined"},
            )
            failed = {
                "status": "failed",
                "failure_reason": "amount_exceeds_payment",
                "payment_id": request.payment_id,
                "amount_cents": request.amount_cents,
                "idempotency_key": key,
            }
            self.webhooks.emit(PAYMENTS, *refund_event("refund.failed", failed))
            return 402, {"error": "amount_exceeds_payment"}
        refund = _Refund(
            id=f"re_{secrets.token_hex(12)}",
            payment_id=request.payment_id,
            amount_cents=request.amount_cents,
            currency=request.currency,
            idempotency_key=key,
        )
        self._refunds[refund.id] = refund
        self._refund_ids_by_key.setdefault(key, []).append(refund.id)
        self._refunded_cents[request.payment_id] = refunded + request.amount_cents
        self.webhooks.emit(PAYMENTS, *refund_event("refund.succeeded", refund.as_json()))
        logger.info(
            "provider.refund.committed refund=%s key=%s",
            refund.id,
            key,
            extra={"action": "provider.refund.committed"},
        )
        return 201, refund.as_json()

    def _outage(self, kind: Kind) -> Reply | None:
        """The outage's 503, before the request is even read: a provider that is down
        checks nothing."""
        with self._lock:
            faults = self._faults
        if not faults.unavailable:
            return None
        self._log_fault(kind, "unavailable")
        return _refusal(503, "service_unavailable", faults.unavailable_retry_after_s)

    def _rate_limited(self, kind: Kind) -> Reply | None:
        if not self._hits(kind, "rate_limit"):
            return None
        self._log_fault(kind, "rate_limit")
        return _refusal(429, "rate_limited", self._faults.rate_limit_retry_after_s)

    def _pre_commit_fault(self, kind: Kind) -> Reply | None:
        limited = self._rate_limited(kind)
        if limited is not None:
            return limited
        if self._hits(kind, "fail_before_commit"):
            self._log_fault(kind, "fail_before_commit")
            return _error(503, "unavailable")
        if self._hits(kind, "conflict"):
            self._log_fault(kind, "conflict")
            return _error(409, "request_in_progress")
        return None

    def _hits(self, kind: Kind, fault: FaultName) -> bool:
        every: int = getattr(self._faults, f"{fault}_every")
        probability: float = getattr(self._faults, f"{fault}_probability")
        hit = False
        if every > 0:
            count = self._counters.get((kind, fault), 0) + 1
            self._counters[(kind, fault)] = count
            hit = count % every == 0
        # Draw only for a fault that is on, so turning one fault on does not shift the
        # sequence another one sees for the same seed.
        if probability > 0.0 and self._random.random() < probability:
            hit = True
        return hit

    def _pruned(self, replay: _Replay) -> bool:
        horizon = self._faults.prune_keys_older_than_s
        # ">=": with 0.0 every key is forgotten at once, whatever the clock's resolution.
        return horizon is not None and time.monotonic() - replay.recorded_at >= horizon

    @staticmethod
    def _log_fault(kind: Kind, fault: str) -> None:
        logger.info(
            "provider.fault kind=%s fault=%s", kind, fault, extra={"action": "provider.fault"}
        )


def _endpoint(method: str, path: str) -> str | None:
    """The API endpoint a request is for, as the request log names it; None for the
    admin routes, the ledger and anything unrouted."""
    if method == "POST" and path == "/refunds":
        return CREATE_REFUND
    if method == "GET" and path == "/refunds":
        return LOOKUP_REFUND
    if method == "GET" and path.startswith("/refunds/") and path.count("/") == 2:
        return GET_REFUND
    if method == "POST" and path == "/emails":
        return SEND_EMAIL
    return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, state: SandboxState) -> None:
        self.state = state
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which can hang for seconds
        # where DNS is missing; the sandbox never needs that name.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        failure = sys.exc_info()[1]
        logger.warning(
            "provider.handler_error error=%s",
            type(failure).__name__,
            extra={"action": "provider.handler_error"},
        )


class _Handler(BaseHTTPRequestHandler):
    server_version = "outbox-sandbox-provider"
    timeout = REQUEST_READ_TIMEOUT

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        # The default line carries the raw request line; the sandbox logs its own lines,
        # with ids and codes only.
        return

    def _dispatch(self, method: str) -> None:
        arrived, arrived_at = time.monotonic(), time.time()
        state = cast(_Server, self.server).state
        parts = urlsplit(self.path)
        path = parts.path.rstrip("/") or "/"
        body = self._read_body()
        reply = (
            _error(400, "invalid_request")
            if body is None
            else self._route(state, method, path, parts.query, body)
        )
        if reply is None:
            return
        endpoint = _endpoint(method, path)
        if endpoint is not None:
            state.record_request(endpoint, arrived, arrived_at, reply)
        state.finish(reply)
        if reply.drop:
            self._drop(path)
            return
        self._send(reply)

    def _route(
        self, state: SandboxState, method: str, path: str, query: str, body: bytes
    ) -> Reply | None:
        routes: dict[str, tuple[str, ...]] = {
            "/healthz": ("GET",),
            "/ledger": ("GET",),
            "/refunds": ("GET", "POST"),
            "/emails": ("POST",),
            "/admin/faults": ("GET", "POST"),
            "/admin/requests": ("GET",),
            "/admin/reset": ("POST",),
        }
        if path.startswith("/refunds/") and path.count("/") == 2:
            if method != "GET":
                return _error(405, "method_not_allowed")
            return state.refund(path.removeprefix("/refunds/"))
        if path not in routes:
            # Not "not_found": that body means "definitively no such refund" to a lookup,
            # and a mistyped route must never read as proof of absence.
            return _error(404, "no_such_route")
        if method not in routes[path]:
            return _error(405, "method_not_allowed")
        if path == "/healthz":
            self._send_text(200, "ok")
            return None
        if path == "/ledger":
            return Reply(200, state.ledger())
        if path == "/refunds" and method == "POST":
            return state.post_refund(self.headers.get("Idempotency-Key"), body)
        if path == "/refunds":
            keys = parse_qs(query).get("idempotency_key", [])
            return state.lookup_by_key(keys[0] if len(keys) == 1 else None)
        if path == "/emails":
            return state.post_email(body, self.headers.get("X-Reference"))
        if path == "/admin/faults" and method == "POST":
            return self._update_faults(state, body)
        if path == "/admin/faults":
            return Reply(200, state.faults.model_dump())
        if path == "/admin/requests":
            return Reply(200, {"requests": state.requests()})
        state.reset()
        return Reply(200, {"status": "reset"})

    @staticmethod
    def _update_faults(state: SandboxState, body: bytes) -> Reply:
        try:
            fields = json.loads(body)
        except ValueError:
            return _error(400, "invalid_request")
        if not isinstance(fields, dict):
            return _error(400, "invalid_request")
        try:
            return Reply(200, state.set_faults(**fields).model_dump())
        except ValidationError:
            return _error(400, "invalid_request")

    def _read_body(self) -> bytes | None:
        declared = self.headers.get("Content-Length")
        if declared is None:
            return b""
        try:
            length = int(declared)
        except ValueError:
            return None
        if not 0 <= length <= MAX_BODY_BYTES:
            return None
        return self.rfile.read(length)

    def _send(self, reply: Reply) -> None:
        payload = json.dumps(reply.body).encode()
        self._send_bytes(reply.status, "application/json", payload, reply.headers)

    def _send_text(self, status: int, text: str) -> None:
        self._send_bytes(status, "text/plain; charset=utf-8", text.encode())

    def _send_bytes(
        self, status: int, content_type: str, payload: bytes, headers: Mapping[str, str] = {}
    ) -> None:
        self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _drop(self, path: str) -> None:
        # The effect is committed; the client must see a lost response, not an answer.
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        logger.info(
            "provider.response.dropped route=%s",
            path,
            extra={"action": "provider.response.dropped"},
        )


class SandboxProvider:
    """The sandbox in this process: ``start()`` serves it on a background thread.

    ``stop()`` then ``start()`` again keeps the ledger and the port: a provider outage.
    """

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = 0,
        payment_amount_cents: int = DEFAULT_PAYMENT_AMOUNT_CENTS,
        faults: Faults | None = None,
        webhooks: WebhookTarget | None = None,
    ) -> None:
        self.host = host
        self._port = port
        self.state = SandboxState(payment_amount_cents, faults or Faults())
        self.state.webhooks.configure(webhooks)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = self.host
        if host in ("", "0.0.0.0", "::"):  # noqa: S104 -- the wildcard is compared, not bound
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self._port}"

    @property
    def faults(self) -> Faults:
        return self.state.faults

    def start(self) -> int:
        if self._server is not None:
            raise RuntimeError("the sandbox provider is already running")
        self.state.set_stopping(False)
        server = _Server(self.host, self._port, self.state)
        self._port = server.server_port
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": SERVE_POLL_SECONDS},
            name=f"sandbox-provider-{self._port}",
            daemon=True,
        )
        self._thread.start()
        self.state.webhooks.start()
        logger.info("provider.started port=%d", self._port, extra={"action": "provider.started"})
        return self._port

    def stop(self) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        self._server = self._thread = None
        # Release requests held by a delay first: server_close() waits for every handler.
        self.state.set_stopping(True)
        server.shutdown()
        server.server_close()
        thread.join()
        self.state.webhooks.stop()
        logger.info("provider.stopped port=%d", self._port, extra={"action": "provider.stopped"})

    def set_faults(self, **fields: Any) -> Faults:
        return self.state.set_faults(**fields)

    def reset(self) -> None:
        self.state.reset()

    def ledger(self) -> Json:
        return self.state.ledger()

    def requests(self, endpoint: str | None = None) -> list[Json]:
        """Every call and lookup received (of ``endpoint`` only, if given: one of
        :data:`ENDPOINTS`), oldest first: ``endpoint``, ``monotonic`` and ``at`` (when it
        arrived, by ``time.monotonic()`` and the wall clock), ``status``,
        ``retry_after_s`` (the ``Retry-After`` it was answered with) and ``dropped``."""
        return self.state.requests(endpoint)

    def executing_keys(self) -> list[str]:
        return self.state.executing_keys()

    @property
    def webhook_target(self) -> WebhookTarget | None:
        return self.state.webhooks.target

    def set_webhooks(self, target: WebhookTarget | None) -> None:
        """Where to send webhooks from now on (None: nowhere), and the secrets to sign with."""
        self.state.webhooks.configure(target)

    def webhooks(self) -> list[dict[str, Any]]:
        """Every webhook sent (each attempt, with the receiver's status) or dropped."""
        return self.state.webhooks.log()

    def webhooks_waiting(self) -> int:
        """Webhooks held by a delay or a reorder window, not sent yet."""
        return self.state.webhooks.waiting()

    def __enter__(self) -> SandboxProvider:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def main() -> None:
    # The CLI module imports this one; importing it when called keeps the two modules
    # from importing each other while they load.
    from outbox.sandbox.cli import main as cli_main

    sys.exit(cli_main())


if __name__ == "__main__":
    main()
