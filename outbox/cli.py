"""The ``outbox`` command.

Every flag that maps to a setting is generated from :class:`Settings`, so its help
always names its ``OUTBOX_*`` variable and the two cannot drift apart.

The daemons add their own subcommands through the ``outbox.commands`` entry point
group: the base package never imports them (docs/design.md section 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from importlib.metadata import entry_points
from typing import Any, TypeVar

import psycopg
from pydantic import SecretStr

from outbox.errors import ConfigurationError, OutboxError, connect_failure
from outbox.loading import TOOLS_ENV, load_registry, module_list
from outbox.logs import configure_logging
from outbox.metrics import version
from outbox.migrate import declare_broker_topology, migrate
from outbox.operator import commands as operator_commands
from outbox.operator import dlq
from outbox.settings import ENV_PREFIX, Settings, load_settings, redact_url
from outbox.text import printable

Command = Callable[[argparse.Namespace, Settings], int]
T = TypeVar("T")

BROKER_SETTINGS = (
    "amqp_url",
    "exchange",
    "queue",
    "dead_letter_exchange",
    "dead_letter_queue",
    "delivery_limit",
)


def add_setting_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    for name in names:
        field = Settings.model_fields[name]
        default = field.default
        shown: object = default
        if isinstance(default, SecretStr):
            shown = redact_url(default.get_secret_value())
        elif isinstance(default, timedelta):
            # str(timedelta(days=7)) is "7 days, 0:00:00"; the flag takes seconds.
            shown = f"{default.total_seconds():g} s"
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            help=f"{field.description} [env {ENV_PREFIX}{name.upper()}; default {shown}]",
        )


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run a daemon's coroutine on uvloop where it is installed (it measured 25-58%
    faster here, docs/design.md section 14), else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def _settings_from(args: argparse.Namespace) -> Settings:
    return load_settings(**{name: getattr(args, name, None) for name in Settings.model_fields})


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    url = settings.libpq_url
    report = migrate(url, roles=args.roles)
    if report.created_database:
        print(f"database {report.database!r} did not exist: created it")
    print(f"schema version {report.schema_version} is applied to {redact_url(url)}")
    if report.roles:
        print(
            f"roles {', '.join(report.roles)} are granted what their components run; "
            "GRANT each to the login role that component connects as"
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
    # Flags win over the variable, as for every setting. The variable is read here, not
    # through Settings, so this command works whatever shape that field takes there.
    modules = module_list(args.tool_modules or [os.environ.get(TOOLS_ENV, "")])
    registry = load_registry(modules)
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
    print(dlq.listing_json(listing) if args.json else listing.text())
    return 0


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

    migrate_parser = commands.add_parser(
        "migrate",
        help="create the database if missing and apply schema.sql (idempotent)",
        description="Create the database if it does not exist, then apply schema.sql. "
        "Safe to run any number of times, from any number of machines at once.",
    )
    add_setting_flags(migrate_parser, "database_url", *BROKER_SETTINGS)
    migrate_parser.add_argument(
        "--broker",
        action="store_true",
        help="also declare the RabbitMQ exchanges, quorum queue and dead-letter queue",
    )
    migrate_parser.add_argument(
        "--roles",
        action="store_true",
        help="also apply roles.sql in the same transaction: create the NOLOGIN group roles "
        "outbox_agent, outbox_dispatcher, outbox_consumer, outbox_operator and "
        "outbox_callbacks if missing "
        "(needs CREATEROLE the first time) and grant each exactly what its component runs",
    )
    migrate_parser.set_defaults(handler=cmd_migrate)

    contracts_parser = commands.add_parser(
        "contracts",
        help="print the contract card of every tool in the given tools modules",
        description="Print each tool's contract card: what it does, what a repeat does, "
        "which errors end it, retry it or leave its outcome unknown, how an unknown outcome "
        "is settled, what voids an approval, how duplicates are handled and what proves the "
        "final state. Needs no database or broker.",
    )
    contracts_parser.add_argument(
        "--tools",
        dest="tool_modules",
        action="append",
        metavar="MODULE",
        help="a module exposing `registry` or `build_registry()`; repeatable, or "
        f"comma-separated [env {TOOLS_ENV}]",
    )
    contracts_parser.add_argument(
        "--json",
        action="store_true",
        help="a JSON list of {name, version, side_effect, card, mcp_annotations}",
    )
    contracts_parser.set_defaults(handler=cmd_contracts)

    dlq_parser = commands.add_parser(
        "dlq",
        help="list or requeue the messages in the dead-letter queue",
        description="Look at the dead-letter queue without losing anything, and send "
        "dead-lettered operation messages back to the operations exchange. Bodies are "
        "never printed beyond the thin envelope (operation id, tool, tool version).",
    )
    dlq_commands = dlq_parser.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    dlq_list = dlq_commands.add_parser(
        "list",
        help="show dead-lettered messages and why they died; leaves them all in the queue",
        description="A snapshot of the dead-letter queue: a count, then per message its id, "
        "its envelope (or its size, if the body is not an envelope) and RabbitMQ's x-death "
        "reason, queue and count. Messages are read without ack and handed back.",
    )
    add_setting_flags(dlq_list, "amqp_url", "dead_letter_queue")
    dlq_list.add_argument(
        "--limit",
        type=dlq.positive_int,
        default=dlq.DEFAULT_LIST_LIMIT,
        help="show at most N messages from the head of the queue "
        f"(default {dlq.DEFAULT_LIST_LIMIT})",
    )
    dlq_list.add_argument("--json", action="store_true", help="one JSON document instead of text")
    dlq_list.set_defaults(handler=cmd_dlq_list)
    dlq_requeue = dlq_commands.add_parser(
        "requeue",
        help="publish dead-lettered operation messages back to the operations exchange",
        description="Republish each selected message with its original routing key, with "
        "publisher confirms and mandatory, and ack its dead-lettered copy only after the "
        "confirm (a crash duplicates, never loses). Bodies that are not an operation "
        "envelope stay in the dead-letter queue. Fix what killed the messages first.",
    )
    add_setting_flags(dlq_requeue, "amqp_url", "exchange", "dead_letter_queue")
    dlq_requeue.add_argument(
        "--limit", type=dlq.positive_int, help="requeue at most N messages (default: no limit)"
    )
    selection = dlq_requeue.add_mutually_exclusive_group(required=True)
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
    dlq_requeue.set_defaults(handler=cmd_dlq_requeue)

    # Operator commands (ops, approvals, stats): they cannot import this module back.
    operator_commands.configure_ops(commands, add_setting_flags)
    operator_commands.configure_approvals(commands, add_setting_flags)
    operator_commands.configure_stats(commands, add_setting_flags)

    for entry in sorted(entry_points(group="outbox.commands"), key=lambda e: e.name):
        entry.load()(commands)
    return parser


def run_command(argv: Sequence[str] | None = None) -> int:
    """Parse, configure logging, run one subcommand; errors become a message and a code
    (2 for configuration, 1 for anything else the runtime refused)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return run_parsed(args, f"outbox {args.command}")


def run_parsed(args: argparse.Namespace, name: str) -> int:
    """Run ``args.handler`` as :func:`run_command` does; ``name`` heads error messages.
    Shared with commands that are not in the wheel (``python -m harness.chaos``), so they
    load settings and fail the same way."""
    try:
        settings = _settings_from(args)
        configure_logging(settings.log_level, settings.log_format)
        handler: Command = args.handler
        code = handler(args, settings)
        # Flushed here rather than at exit, so that a reader gone away is met below.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _reader_gone()
    except ConfigurationError as error:
        _report(name, f"configuration error: {error}")
        return 2
    except OutboxError as error:
        _report(name, f"error: {error}")
        return 1
    except psycopg.Error as error:
        # A driver error no command translated: its text can quote the connection string.
        sqlstate = f"SQLSTATE {error.sqlstate}, " if error.sqlstate else ""
        _report(name, f"error: database error ({sqlstate}{connect_failure(error)})")
        return 1


def _report(name: str, message: str) -> None:
    # One line, and nothing a terminal would act on: messages can carry names and ids
    # someone else chose.
    print(f"{name}: {printable(message)}", file=sys.stderr)


# What a shell reports for a process killed by SIGPIPE (128 + 13), as for coreutils in
# `cat big | head`. Not 0: the output was cut short, and a `set -o pipefail` script
# should see that as it does for any other command.
EXIT_BROKEN_PIPE = 141


def _reader_gone() -> int:
    """The reader of stdout (``| head``) went away: stop quietly, as Python's docs on
    SIGPIPE advise. Python ignores SIGPIPE, so the write raised instead of killing us;
    stdout goes to /dev/null so that the flush at exit cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def main() -> None:
    sys.exit(run_command())


if __name__ == "__main__":
    main()
