"""``outbox consumer`` (also ``python -m consumer``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from consumer.processes import supervise
from consumer.worker import DEFAULT_METRICS_PORT, Consumer
from outbox.cli import (
    add_declare_topology_flag,
    add_setting_flags,
    add_tools_flag,
    positive_int_up_to,
    run_async,
    run_command,
)
from outbox.connections import DATABASE_BOUND_SETTINGS
from outbox.daemon import freeze_startup_heap
from outbox.loading import registry_from
from outbox.settings import Settings, settings_in
from outbox.signals import run_until_signalled

logger = logging.getLogger(__name__)

# More processes than this on one host is a typo, not a plan (a host with more cores
# than that runs several deployments, or is a database).
MAX_PROCESSES = 64

SETTINGS = (
    "database_url",
    *settings_in("broker"),
    "consume_queue",
    "amqp_heartbeat",
    "prefetch",
    "lease_margin",
    "reconcile_interval",
    "reconcile_batch",
    "undeliverable_after_requeues",
    "approval_denial_grace",
    "requeue_stale_after",
    *DATABASE_BOUND_SETTINGS,
    "metrics_host",
    "metrics_port",
)


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "consumer",
        help="execute operations from RabbitMQ and reconcile unknown outcomes (the daemon)",
        description="Execute each operation's effect at most once per proven-absent outcome, "
        "and reconcile every unknown outcome before anything else happens to it. Tools come "
        "from modules that expose a Registry (--tools a.b,c.d or OUTBOX_TOOLS). Serves "
        f"/metrics and /healthz (default port {DEFAULT_METRICS_PORT}). SIGTERM or SIGINT "
        "stops taking deliveries and lets the effects in hand finish; a second one exits "
        "at once.",
    )
    add_setting_flags(parser, *SETTINGS)
    parser.add_argument(
        "--processes",
        type=positive_int_up_to(MAX_PROCESSES),
        default=1,
        help="run this many consumer processes and supervise them, so that one host uses "
        "its cores; each serves metrics on --metrics-port plus its index [default 1]",
    )
    add_tools_flag(parser)
    add_declare_topology_flag(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.processes > 1:
        port = DEFAULT_METRICS_PORT if settings.metrics_port is None else settings.metrics_port
        return supervise(settings, args.processes, port)
    freeze_startup_heap()
    consumer = Consumer(settings, registry_from(settings, required=True))
    run_async(
        run_until_signalled(
            "consumer", consumer.run, consumer.stop, finishing="finishing the effects in hand"
        )
    )
    return 0


def main() -> None:
    sys.exit(run_command(["consumer", *sys.argv[1:]]))
