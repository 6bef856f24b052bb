"""The ``outbox`` command, one ``configure_*`` per command group it builds itself.

The toolkit every command uses lives beside it: the shared flags and argument types in
:mod:`outbox.cli.arguments`, how a command runs and exits in :mod:`outbox.cli.run`. Both
are re-exported here, as the daemons and the other front ends import them.

The daemons add their own subcommands through the ``outbox.commands`` entry point
group: the base package never imports them (docs/design.md section 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from importlib.metadata import entry_points
from typing import Any

import psycopg

from outbox.cli.arguments import (
    add_declare_topology_flag,
    add_setting_flags,
    add_tools_flag,
    positive_int,
    positive_int_up_to,
    positive_seconds,
    seconds,
    settings_from,
)
from outbox.cli.run import (
    EXIT_BROKEN_PIPE,
    EXIT_CONFIGURATION,
    EXIT_FAILED,
    EXIT_OK,
    Command,
    run_async,
    run_command,
    run_parsed,
)
from outbox.connections import command_transaction
from outbox.errors import OutboxError
from outbox.loading import registry_from
from outbox.metrics import version
from outbox.migrate import LOCK_TIMEOUT_SECONDS, LOCK_TRIES, declare_broker_topology, migrate
from outbox.operator import commands as operator_commands
from outbox.operator import dlq, render
from outbox.operator.views import (
    DeadLetterView,
    dead_letter_views,
    dead_letter_views_without_database,
)
from outbox.settings import Settings, settings_in
from outbox.store import Store
from outbox.urls import redact_url

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CONFIGURATION",
    "EXIT_FAILED",
    "EXIT_OK",
    "Command",
    "add_declare_topology_flag",
    "add_setting_flags",
    "add_tools_flag",
    "build_parser",
    "main",
    "positive_int",
    "positive_int_up_to",
    "positive_seconds",
    "run_async",
    "run_command",
    "run_parsed",
    "seconds",
    "settings_from",
]

# `outbox` reaches this through the shell: a subcommand is a parser under it.
Commands = Any

BROKER_SETTINGS = settings_in("broker")


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    url = settings.libpq_url
    report = migrate(
        url,
        roles=args.roles,
        allow_schema_creators=args.allow_schema_creators,
        lock_timeout=args.lock_timeout,
        lock_tries=args.lock_tries,
    )
    if report.created_database:
        print(f"database {report.database!r} did not exist: created it")
    print(f"schema version {report.schema_version} is applied to {redact_url(url)}")
    if report.roles:
        print(
            f"roles {', '.join(report.roles)} are granted what their components run; "
            "GRANT each to the login role that component connects as"
        )
    if report.schema_creators:
        print(
            "warning: roles other than the schema's owner may still create objects in it: "
            f"{', '.join(report.schema_creators)} (--allow-schema-creators)",
            file=sys.stderr,
        )
    if args.broker:
        topology = run_async(declare_broker_topology(settings))
        print(
            f"broker topology declared: exchange {topology.exchange!r} -> quorum queue "
            f"{topology.queue!r} (delivery limit {topology.delivery_limit}, dead letters to "
            f"{topology.dead_letter_exchange!r} -> {topology.dead_letter_queue!r})"
        )
    return 0


def cmd_contracts(args: argparse.Namespace, settings: Settings) -> int:
    registry = registry_from(settings, required=True)
    if args.json:
        cards = [
            {
                "name": contract.name,
                "version": contract.version,
                "side_effect": contract.side_effect.value,
                "card": contract.card(),
                "mcp_annotations": contract.mcp_annotations(),
            }
            for contract in registry
        ]
        print(json.dumps(cards, indent=2, ensure_ascii=False))
    else:
        print("\n\n".join(contract.card() for contract in registry))
    return 0


def cmd_dlq_list(args: argparse.Namespace, settings: Settings) -> int:
    listing = run_async(dlq.list_dead_letters(settings, limit=args.limit))
    now = datetime.now(UTC)
    views = _dead_letter_views(settings, listing)
    if args.json:
        print(json.dumps(render.dead_letters_json(listing, views, now), indent=2))
    else:
        print(render.dead_letters_text(listing, views, now))
    return 0


def _dead_letter_views(settings: Settings, listing: dlq.Listing) -> list[DeadLetterView]:
    """The messages with their operations, as the console's dead-letter page reads them;
    the broker's view alone (and a line on stderr) when the operations cannot be read."""
    if not any(message.parsed for message in listing.messages):
        return [dead_letter_views_without_database(m) for m in listing.messages]
    try:
        with command_transaction(settings) as connection:
            connection.read_only = True
            return dead_letter_views(Store(connection), listing.messages)
    except (OutboxError, psycopg.Error) as error:
        print(
            f"outbox dlq list: the operations could not be read ({type(error).__name__}); "
            "showing what the broker holds",
            file=sys.stderr,
        )
        return [dead_letter_views_without_database(m) for m in listing.messages]


def cmd_dlq_requeue(args: argparse.Namespace, settings: Settings) -> int:
    report = run_async(
        dlq.requeue_dead_letters(
            settings,
            message_ids=None if args.all_messages else args.message_ids,
            limit=args.limit,
        )
    )
    print(report.text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox", description="effect-outbox: the runtime that owns your agent's effects."
    )
    parser.add_argument("--version", action="version", version=f"outbox {version()}")
    add_setting_flags(parser, "log_level", "log_format")
    # Not required: a bare ``outbox`` is someone asking what it does (run_command).
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    configure_migrate(commands)
    configure_contracts(commands)
    configure_dlq(commands)
    operator_commands.configure_ops(commands)
    operator_commands.configure_approvals(commands)
    operator_commands.configure_stats(commands)
    operator_commands.configure_providers(commands)
    for entry in sorted(entry_points(group="outbox.commands"), key=lambda e: e.name):
        entry.load()(commands)
    return parser


def configure_migrate(commands: Commands) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "migrate",
        help="create the database if missing and apply schema.sql (idempotent)",
        description="Create the database if it does not exist, then apply schema.sql. "
        "Safe to run any number of times, from any number of machines at once; on a "
        "schema that is current it applies nothing and locks no table.",
    )
    add_setting_flags(parser, "database_url", *BROKER_SETTINGS)
    parser.add_argument(
        "--broker",
        action="store_true",
        help="also declare the RabbitMQ exchanges, quorum queue and dead-letter queue",
    )
    parser.add_argument(
        "--roles",
        action="store_true",
        help="also apply roles.sql in the same transaction: create the NOLOGIN group roles "
        "outbox_agent, outbox_dispatcher, outbox_consumer, outbox_operator and "
        "outbox_callbacks if missing "
        "(needs CREATEROLE the first time) and grant each exactly what its component runs; "
        "revoke CREATE on the schema from PUBLIC, and stop if another role still holds it",
    )
    parser.add_argument(
        "--lock-timeout",
        type=positive_seconds,
        default=LOCK_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="when the schema changes, how long each statement waits for a table's lock "
        "before letting go and trying again; readers and writers of that table queue "
        f"behind it meanwhile (default {LOCK_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--lock-tries",
        type=positive_int_up_to(100),
        default=LOCK_TRIES,
        metavar="N",
        help="how many times to try before failing with the sessions that held the lock "
        f"(default {LOCK_TRIES})",
    )
    parser.add_argument(
        "--allow-schema-creators",
        action="store_true",
        help="with --roles: finish even when roles other than the schema's owner may "
        "create objects in it (named in a warning)",
    )
    parser.set_defaults(handler=cmd_migrate)


def configure_contracts(commands: Commands) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "contracts",
        help="print the contract card of every tool in the given tools modules",
        description="Print each tool's contract card: what it does, what a repeat does, "
        "which errors end it, retry it or leave its outcome unknown, how an unknown outcome "
        "is settled, what voids an approval, how duplicates are handled and what proves the "
        "final state. Needs no database or broker.",
    )
    add_tools_flag(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="a JSON list of {name, version, side_effect, card, mcp_annotations}",
    )
    parser.set_defaults(handler=cmd_contracts)


def configure_dlq(commands: Commands) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "dlq",
        help="list or requeue the messages in the dead-letter queue",
        description="Look at the dead-letter queue without losing anything, and send "
        "dead-lettered operation messages back to the operations exchange. Bodies are "
        "never printed beyond the thin envelope (operation id, tool, tool version).",
    )
    actions = parser.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    listing = actions.add_parser(
        "list",
        help="show dead-lettered messages and why they died; leaves them all in the queue",
        description="A snapshot of the dead-letter queue: a count, then per message its id, "
        "its envelope (or its size, if the body is not an envelope), RabbitMQ's x-death "
        "reason, queue and count, why it died (the consumer's reason, read from the "
        "database, where it wrote one) and whether its operation is already escalated or "
        "settled. Messages are read without ack and handed back.",
    )
    add_setting_flags(listing, "amqp_url", "dead_letter_queue", "database_url")
    listing.add_argument(
        "--limit",
        type=positive_int,
        default=dlq.DEFAULT_LIST_LIMIT,
        help="show at most N messages from the head of the queue "
        f"(default {dlq.DEFAULT_LIST_LIMIT})",
    )
    listing.add_argument("--json", action="store_true", help="one JSON document instead of text")
    listing.set_defaults(handler=cmd_dlq_list)
    requeue = actions.add_parser(
        "requeue",
        help="publish dead-lettered operation messages back to the operations exchange",
        description="Republish each selected message with its original routing key, with "
        "publisher confirms and mandatory, and ack its dead-lettered copy only after the "
        "confirm (a crash duplicates, never loses). Bodies that are not an operation "
        "envelope stay in the dead-letter queue. Fix what killed the messages first.",
    )
    add_setting_flags(requeue, "amqp_url", "exchange", "dead_letter_queue")
    requeue.add_argument(
        "--limit", type=positive_int, help="requeue at most N messages (default: no limit)"
    )
    selection = requeue.add_mutually_exclusive_group(required=True)
    selection.add_argument(
        "--all",
        dest="all_messages",
        action="store_true",
        help="every message in the queue when the command starts",
    )
    selection.add_argument(
        "--message-id",
        dest="message_ids",
        action="extend",
        nargs="+",
        metavar="ID",
        help="only messages with these ids (repeatable)",
    )
    requeue.set_defaults(handler=cmd_dlq_requeue)


def main() -> None:
    sys.exit(run_command())
