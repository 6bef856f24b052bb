"""The ``outbox`` command.

Every flag that maps to a setting is generated from :class:`Settings`, so its help
always names its ``OUTBOX_*`` variable and the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pydantic import SecretStr

from outbox.errors import OutboxError
from outbox.logs import configure_logging
from outbox.migrate import migrate
from outbox.settings import ENV_PREFIX, Settings, load_settings, redact_url

Command = Callable[[argparse.Namespace, Settings], int]


def add_setting_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    for name in names:
        field = Settings.model_fields[name]
        default = field.default
        shown = (
            redact_url(default.get_secret_value()) if isinstance(default, SecretStr) else default
        )
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            help=f"{field.description} [env {ENV_PREFIX}{name.upper()}; default {shown}]",
        )


def _settings_from(args: argparse.Namespace) -> Settings:
    return load_settings(**{name: getattr(args, name, None) for name in Settings.model_fields})


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    url = settings.libpq_url
    report = migrate(url)
    if report.created_database:
        print(f"database {report.database!r} did not exist: created it")
    print(f"schema version {report.schema_version} is applied to {redact_url(url)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox", description="effect-outbox: the runtime that owns your agent's effects."
    )
    add_setting_flags(parser, "log_level", "log_format")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate_parser = commands.add_parser(
        "migrate",
        help="create the database if missing and apply schema.sql (idempotent)",
        description="Create the database if it does not exist, then apply schema.sql. "
        "Safe to run any number of times, from any number of machines at once.",
    )
    add_setting_flags(migrate_parser, "database_url")
    migrate_parser.set_defaults(handler=cmd_migrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = _settings_from(args)
        configure_logging(settings.log_level, settings.log_format)
        handler: Command = args.handler
        return handler(args, settings)
    except OutboxError as error:
        print(f"outbox {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
