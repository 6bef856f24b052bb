"""The ``outbox`` command: the parser of every command group (:func:`build_parser`), and
the two groups that are not an operator's (``migrate``, ``contracts``). The operator's
commands (``ops``, ``approvals``, ``stats``, ``providers``, ``dlq``, ``history``) are
:mod:`outbox.operator`'s; this package imports them and they never import it back.

The toolkit every command uses lives beside it, in leaves that import no command group:
the shared flags and argument types in :mod:`outbox.cli.arguments`, how a command runs
and exits in :mod:`outbox.cli.run`. Both are re-exported here, as the daemons and the
other front ends import them.

The daemons add their own subcommands through the ``outbox.commands`` entry point
group: the base package never imports them (docs/design.md section 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

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
    run_parsed,
)
from outbox.loading import registry_from
from outbox.metrics import version
from outbox.migrate import LOCK_TIMEOUT_SECONDS, LOCK_TRIES, declare_broker_topology, migrate
from outbox.settings import Settings, settings_in
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
        for queue, tools in topology.tool_queues:
            print(f"  tools {', '.join(tools)} -> quorum queue {queue!r} (its own leader)")
        if topology.tool_queues:
            print(f"  every other tool -> {topology.queue!r}")
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


def build_parser() -> argparse.ArgumentParser:
    # Here rather than at the top: the operator layer imports outbox.cli.arguments and
    # outbox.cli.run, and Python runs this package's __init__ before either, so a
    # top-level import would load every operator command for anyone who wants a flag.
    from outbox.operator import commands as operator_commands
    from outbox.operator import dlq_commands, history_commands

    parser = argparse.ArgumentParser(
        prog="outbox", description="effect-outbox: the runtime that owns your agent's effects."
    )
    parser.add_argument("--version", action="version", version=f"outbox {version()}")
    add_setting_flags(parser, "log_level", "log_format")
    # Not required: a bare ``outbox`` is someone asking what it does (run_command).
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    configure_migrate(commands)
    configure_contracts(commands)
    dlq_commands.configure_dlq(commands)
    operator_commands.configure_ops(commands)
    operator_commands.configure_approvals(commands)
    operator_commands.configure_stats(commands)
    operator_commands.configure_providers(commands)
    history_commands.configure_history(commands)
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


def run_command(argv: Sequence[str] | None = None) -> int:
    """Parse, configure logging, run one subcommand; errors become a message and a code
    (2 for configuration, 1 for anything else the runtime refused)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    return run_parsed(args, f"outbox {args.command}")


def main() -> None:
    sys.exit(run_command())
