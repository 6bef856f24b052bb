"""``outbox dispatcher`` (also ``python -m dispatcher``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from dispatcher.daemon import DEFAULT_METRICS_PORT, Dispatcher
from outbox.cli import add_declare_topology_flag, add_setting_flags, run_async, run_command
from outbox.connections import DATABASE_BOUND_SETTINGS
from outbox.daemon import failed_peer, freeze_startup_heap, is_transient
from outbox.errors import ServiceUnavailable, connect_failure
from outbox.settings import Settings, settings_in
from outbox.signals import run_until_signalled

logger = logging.getLogger(__name__)

SETTINGS = (
    "database_url",
    *settings_in("broker"),
    "amqp_heartbeat",
    "batch_size",
    "dispatch_lanes",
    "poll_interval",
    "publish_timeout",
    "publish_retry_initial",
    "publish_retry_max",
    "retention",
    *DATABASE_BOUND_SETTINGS,
    "metrics_host",
    "metrics_port",
)
DRAIN_CONNECT_ATTEMPTS = 5


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "dispatcher",
        help="publish committed outbox rows to RabbitMQ (the daemon)",
        description="Publish committed outbox rows to RabbitMQ with publisher confirms, at "
        f"least once. Serves /metrics and /healthz (default port {DEFAULT_METRICS_PORT}). "
        "SIGTERM or SIGINT finishes the batch in hand and exits 0; a second one exits at once.",
    )
    add_setting_flags(parser, *SETTINGS)
    add_declare_topology_flag(parser)
    parser.add_argument(
        "--once",
        action="store_true",
        help="publish until no row is available, then exit (1 if any publish failed)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    freeze_startup_heap()
    dispatcher = Dispatcher(settings)
    if args.once:
        dispatcher.connect_attempts = DRAIN_CONNECT_ATTEMPTS
        try:
            report = run_async(dispatcher.drain())
        except Exception as failure:
            if not is_transient(failure):
                raise
            raise ServiceUnavailable(
                f"gave up on the {failed_peer(failure)} after {DRAIN_CONNECT_ATTEMPTS} attempts "
                f"({connect_failure(failure)}); rows stay pending for the next run"
            ) from None
        print(f"published={report.published} failed={report.failed}")
        return 0 if report.failed == 0 else 1
    run_async(
        run_until_signalled(
            "dispatcher", dispatcher.run, dispatcher.stop, finishing="finishing the batch in hand"
        )
    )
    return 0


def main() -> None:
    sys.exit(run_command(["dispatcher", *sys.argv[1:]]))
