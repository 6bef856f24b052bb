"""``outbox callbacks serve``: one route per provider the contracts declare
(``POST /callbacks/<provider>``), ``/healthz`` and ``/metrics``, served by uvicorn
(the console's stack: Starlette, extra ``callbacks`` or ``console``).

Each request goes through :func:`outbox.callbacks.record_callback_async` on a pooled
connection of its own, as the ``outbox_callbacks`` role: verified, read, recorded once.
Answers: 200 with what it came to (recorded, duplicate, unmatched, ignored: a provider
must not retry any of those), 400 for a signature or timestamp that does not verify, 413
for a body over the limit, 422 for a payload that reads as no callback, 503 when the
database is away (the provider retries later). Nothing of a request's headers or body
reaches a log line, a metric label or a response.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors

from outbox import schema
from outbox.callback_policy import CallbackStatus
from outbox.callbacks import REFUSED_STATUS, CallbackReceiver, Received, record_callback_async
from outbox.callbacks.verify import REFUSED_REASONS, SECRETS_ENV, SECRETS_FILE_ENV
from outbox.cli import add_setting_flags, add_tools_flag
from outbox.connections import DatabaseBounds, SessionPool
from outbox.contracts import Registry
from outbox.daemon import is_transient_database_error
from outbox.errors import CallbackRefused, ConfigurationError, DatabaseError, SchemaMissing
from outbox.loading import registry_from
from outbox.logs import log_fields
from outbox.metrics import CallbackMetrics, prime
from outbox.models import display_operation_id
from outbox.serving import SERVING_SETTINGS, Limits, add_bind_flags, check_port, needs_extra
from outbox.settings import Settings, redact_url

logger = logging.getLogger("outbox.callbacks")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8750
APPLICATION_NAME = "outbox-callbacks"


@dataclass
class CallbackService:
    """What a request needs: the receiver, its metrics, and a connection pool."""

    receiver: CallbackReceiver
    metrics: CallbackMetrics
    pool: SessionPool

    @classmethod
    def create(cls, receiver: CallbackReceiver, settings: Settings) -> CallbackService:
        bounds = DatabaseBounds.from_settings(settings)

        async def connect() -> psycopg.AsyncConnection[Any]:
            return await psycopg.AsyncConnection.connect(
                settings.libpq_url, application_name=APPLICATION_NAME, **bounds.libpq_parameters()
            )

        metrics = CallbackMetrics.create()
        prime_callback_metrics(metrics, receiver.providers)
        return cls(
            receiver,
            metrics,
            SessionPool(connect, transaction_seconds=bounds.transaction, idle=2, most=16),
        )


def prime_callback_metrics(metrics: CallbackMetrics, providers: list[str]) -> None:
    """Every label set this server can report, at 0 from its start."""
    prime(metrics.received, providers, [str(status) for status in CallbackStatus])
    prime(metrics.duplicates, providers, ("same", "different"))
    prime(metrics.refused, providers, REFUSED_REASONS)
    prime(metrics.unmatched, providers)
    prime(metrics.ignored, providers)


def create_app(service: CallbackService) -> Any:
    """The ASGI application (Starlette): the web stack is imported here, when serving."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    def receive_for(provider: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                body = await _read_body(request, service.receiver.max_body)
                async with service.pool.transaction() as connection:
                    received = await record_callback_async(
                        connection, service.receiver, provider, body, dict(request.headers)
                    )
            except CallbackRefused as refused:
                _note_refused(service, provider, refused.reason)
                return JSONResponse({"error": refused.reason}, REFUSED_STATUS[refused.reason])
            except (DatabaseError, psycopg.Error, OSError) as failed:
                answer: Response = _database_failed(service, provider, failed)
                return answer
            _count(service.metrics, provider, received)
            return JSONResponse({"result": received.result})

        return endpoint

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await service.pool.close()

    routes = [
        Route(f"/callbacks/{name}", receive_for(name), methods=["POST"])
        for name in service.receiver.providers
    ]
    routes += [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _read_body(request: Any, limit: int) -> bytes:
    """At most ``limit`` bytes, whatever Content-Length claims: a larger body is refused
    as soon as it is known to be larger, before it is buffered."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise CallbackRefused("too_large" if declared.isdigit() else "malformed")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise CallbackRefused("too_large", f"the callback's body is over {limit} bytes")
    return bytes(body)


def _note_refused(service: CallbackService, provider: str, reason: str) -> None:
    service.metrics.refused.labels(provider, reason).inc()
    log_fields(
        logger,
        logging.WARNING,
        "callbacks.refused",
        "a callback was refused; nothing was recorded",
        provider=provider,
        reason=reason,
    )


def refused_at_the_door(service: CallbackService) -> Callable[[Any, str], None]:
    """Counts a body the serving layer refused as too large, on a provider's route, as
    the receiver counts its own: the serving layer answers before the receiver runs."""

    def refused(scope: Any, error: str) -> None:
        provider = str(scope.get("path", "")).removeprefix("/callbacks/")
        if error == "too_large" and provider in service.receiver.providers:
            _note_refused(service, provider, "too_large")

    return refused


def _count(metrics: CallbackMetrics, provider: str, received: Received) -> None:
    receipt, report = received.receipt, received.report
    fields: dict[str, object] = {"provider": provider, "result": received.result}
    if receipt is None or report is None:
        metrics.ignored.labels(provider).inc()
    else:
        fields.update(callback=receipt.callback_id, status=str(report.status))
        if receipt.operation_id is not None:
            fields["id"] = display_operation_id(receipt.operation_id)
        if receipt.result == "duplicate":
            payload = "same" if receipt.same_payload else "different"
            metrics.duplicates.labels(provider, payload).inc()
            fields["payload"] = payload
        else:
            metrics.received.labels(provider, str(report.status)).inc()
            if receipt.result == "unmatched":
                metrics.unmatched.labels(provider).inc()
    level = (
        logging.WARNING
        if received.receipt is not None and not received.receipt.same_payload
        else logging.INFO
    )
    log_fields(logger, level, f"callbacks.{received.result}", "a callback was received", **fields)


def _database_failed(service: CallbackService, provider: str, failed: BaseException) -> Any:
    from starlette.responses import JSONResponse

    driver = getattr(failed, "driver_error", None) or failed
    if isinstance(driver, psycopg.errors.IntegrityError):
        # The inbox's checks refused a value the receiver's own let through: the payload
        # is the provider's to fix, and retrying it would never succeed.
        service.metrics.refused.labels(provider, "malformed").inc()
        log_fields(
            logger,
            logging.WARNING,
            "callbacks.refused",
            "the inbox refused a callback's values; nothing was recorded",
            provider=provider,
            reason="malformed",
            sqlstate=getattr(driver, "sqlstate", None),
        )
        return JSONResponse({"error": "malformed"}, 422)
    log_fields(
        logger,
        logging.WARNING if is_transient_database_error(failed) else logging.ERROR,
        "callbacks.database_failed",
        "the callback could not be recorded; the provider will send it again",
        provider=provider,
        error=type(failed).__name__,
    )
    return JSONResponse({"error": "unavailable"}, 503)


# --- the command -------------------------------------------------------------------------


def add_serve_command(actions: Any) -> None:
    parser: argparse.ArgumentParser = actions.add_parser(
        "serve",
        help="receive provider callbacks: one route per provider, /healthz, /metrics",
        description="Serve POST /callbacks/<provider> for every provider the tools' "
        "contracts declare, plus /healthz and /metrics. Each callback is verified with its "
        f"provider's secrets ({SECRETS_ENV}=provider:secret[,...], or {SECRETS_FILE_ENV}: "
        "never a flag), inside the replay window, and recorded once by its event id; the "
        "consumer applies it. Connect as a login that is a member of outbox_callbacks. "
        "Needs the callbacks extra (pip install 'effect-outbox[callbacks]'); put TLS in "
        "front of it.",
    )
    add_bind_flags(parser, DEFAULT_HOST, DEFAULT_PORT)
    add_tools_flag(parser, used_for="their contracts declare the providers to serve")
    add_setting_flags(
        parser, "database_url", "callback_tolerance", "callback_max_body", *SERVING_SETTINGS
    )
    parser.set_defaults(handler=run)


def receiver_for(registry: Registry, settings: Settings) -> CallbackReceiver:
    return CallbackReceiver(
        registry, tolerance=settings.callback_tolerance, max_body=settings.callback_max_body
    )


def check_schema(settings: Settings) -> None:
    """The inbox and its function exist, or the command stops naming `outbox migrate`."""
    try:
        with psycopg.connect(
            settings.libpq_url,
            application_name=APPLICATION_NAME,
            **DatabaseBounds.from_settings(settings).libpq_parameters(),
        ) as connection:
            current = schema.schema_is_current(connection)
    except psycopg.Error as error:
        raise ConfigurationError(
            f"could not reach {redact_url(settings.libpq_url)} to check its schema "
            f"(SQLSTATE {error.sqlstate or 'unknown'})"
        ) from None
    if not current:
        raise SchemaMissing(
            f"{redact_url(settings.libpq_url)} has no callbacks inbox (schema version 7): run "
            "`outbox migrate --roles`"
        )


def run(args: argparse.Namespace, settings: Settings) -> int:
    check_port(args.port)
    registry = registry_from(settings, required=True)
    receiver = receiver_for(registry, settings)
    with needs_extra("outbox callbacks serve", "callbacks"):
        import starlette  # noqa: F401  (create_app's stack, imported when it runs)

        from outbox.serving.server import AppServer
    check_schema(settings)
    service = CallbackService.create(receiver, settings)
    server = AppServer(
        create_app(service),
        args.host,
        args.port,
        name=APPLICATION_NAME,
        limits=Limits.from_settings(settings, max_body=settings.callback_max_body),
        lifespan="on",
        refused=refused_at_the_door(service),
    )
    routes = ", ".join(f"/callbacks/{name}" for name in receiver.providers)
    print(f"outbox callbacks: serving {routes} on {server.url}", flush=True)
    log_fields(
        logger,
        logging.INFO,
        "callbacks.listening",
        "serving provider callbacks",
        port=server.port,
        providers=",".join(receiver.providers),
    )
    server.serve()
    return 0
