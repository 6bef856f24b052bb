"""``outbox provider`` (also ``python -m outbox.sandbox.provider``): serve the sandbox.

Fault flags are generated from :class:`Faults`, so a flag and the field it sets can
never drift apart; a flag beats the same field in ``--faults``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from pydantic import ValidationError

from outbox.callbacks.verify import SECRETS_ENV, SECRETS_FILE_ENV, secrets_from_environment
from outbox.errors import ConfigurationError
from outbox.logs import configure_logging, log_fields
from outbox.sandbox.provider import (
    DEFAULT_HOST,
    DEFAULT_PAYMENT_AMOUNT_CENTS,
    DEFAULT_PORT,
    Faults,
    SandboxProvider,
)
from outbox.sandbox.webhooks import EMAIL, PAYMENTS, WebhookTarget
from outbox.settings import Settings, load_settings

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "Serve a payment-provider sandbox over HTTP: POST /refunds (idempotency keys), "
    "GET /refunds?idempotency_key=, POST /emails (not idempotent), GET /ledger, "
    "/admin/faults to inject failures (an outage, a rate limit, lost responses, ...) and "
    "GET /admin/requests for when each call arrived; with --webhook-url, signed webhooks "
    "after each refund and email. Prints 'provider.listening host=... port=...' to "
    "stderr once it accepts connections; SIGTERM or SIGINT stops it with exit code 0."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind [{DEFAULT_HOST}]")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"0 picks a free port [{DEFAULT_PORT}]"
    )
    parser.add_argument(
        "--payment-amount-cents",
        type=int,
        default=DEFAULT_PAYMENT_AMOUNT_CENTS,
        help=f"captured amount of every payment [{DEFAULT_PAYMENT_AMOUNT_CENTS}]",
    )
    parser.add_argument(
        "--webhook-url",
        default=None,
        metavar="URL",
        help="send signed webhooks to URL/callbacks/<provider> (outbox callbacks serve), "
        f"signed with the secrets of {SECRETS_ENV} or {SECRETS_FILE_ENV} "
        "(sandbox-payments, sandbox-email) [none]",
    )
    parser.add_argument(
        "--faults",
        metavar="JSON",
        default=None,
        help="fault configuration as a JSON object, e.g. '{\"drop_response_every\": 3}'",
    )
    for name, field in Faults.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        help_text = f"{field.description} [{field.default}]"
        if field.annotation is bool:
            parser.add_argument(
                flag,
                dest=f"fault_{name}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            # Strings on purpose: Faults validates and converts them, with its bounds.
            parser.add_argument(
                flag,
                dest=f"fault_{name}",
                default=None,
                metavar="N" if field.annotation is int else "X",
                help=help_text,
            )


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "provider",
        help="serve the payment-provider sandbox (refunds, emails, injectable faults)",
        description=DESCRIPTION,
    )
    add_arguments(parser)
    parser.set_defaults(handler=run)


def faults_from(args: argparse.Namespace) -> Faults:
    fields: dict[str, Any] = {}
    if args.faults:
        try:
            given = json.loads(args.faults)
        except ValueError:
            raise ConfigurationError("--faults is not valid JSON") from None
        if not isinstance(given, dict):
            raise ConfigurationError("--faults must be a JSON object")
        fields.update(given)
    for name in Faults.model_fields:
        value = getattr(args, f"fault_{name}")
        if value is not None:
            fields[name] = value
    try:
        return Faults.model_validate(fields)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, problem['loc']))}: {problem['msg']}"
            for problem in error.errors(include_input=False, include_url=False)
        )
        raise ConfigurationError(f"invalid faults: {problems}") from None


def webhook_target(url: str | None) -> WebhookTarget | None:
    """Where the webhooks go, signed with each sandbox provider's secrets from the
    environment: the same variables `outbox callbacks serve` verifies them with."""
    if not url:
        return None
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError("--webhook-url must be an http:// or https:// URL")
    configured = secrets_from_environment()
    missing = [name for name in (PAYMENTS.name, EMAIL.name) if name not in configured]
    if missing:
        raise ConfigurationError(
            f"--webhook-url needs secrets for {', '.join(missing)}: set {SECRETS_ENV} "
            f"(provider:secret,...) or {SECRETS_FILE_ENV}"
        )
    return WebhookTarget(url, {name: configured[name] for name in (PAYMENTS.name, EMAIL.name)})


def run(args: argparse.Namespace, settings: Settings) -> int:
    faults = faults_from(args)
    if args.payment_amount_cents <= 0:
        raise ConfigurationError("--payment-amount-cents must be positive")
    provider = SandboxProvider(
        host=args.host,
        port=args.port,
        payment_amount_cents=args.payment_amount_cents,
        faults=faults,
        webhooks=webhook_target(args.webhook_url),
    )
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only flag it: logging here could wait on a lock the interrupted code holds.
        received.append(signum)
        stop.set()

    # Installed before the listening line: a supervisor may signal as soon as it reads it.
    previous = {
        signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        try:
            port = provider.start()
        except OSError as error:
            raise ConfigurationError(
                f"cannot listen on {args.host}:{args.port}: {error.strerror or error}"
            ) from None
        print(f"provider.listening host={args.host} port={port}", file=sys.stderr, flush=True)
        stop.wait()
        log_fields(
            logger,
            logging.INFO,
            "provider.stopping",
            "stopping",
            signal=signal.Signals(received[0]).name,
        )
    finally:
        provider.stop()
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m outbox.sandbox.provider", description=DESCRIPTION
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        configure_logging(settings.log_level, settings.log_format)
        return run(args, settings)
    except ConfigurationError as error:
        print(f"provider: configuration error: {error}", file=sys.stderr)
        return 2
