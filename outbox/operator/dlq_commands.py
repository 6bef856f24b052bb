"""``outbox dlq list``, ``requeue``, ``discard`` and ``discarded``: the handlers and
their parser.

The queue itself is :mod:`outbox.operator.dlq` (a discard and its record
:mod:`outbox.operator.dlq_discard`); each message beside its operation is
:func:`outbox.operator.views.dead_letter_views`, as the console's dead-letter page reads
it; the text and JSON are :mod:`outbox.operator.render`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TypeAlias

import psycopg

from outbox import store
from outbox.cli.arguments import add_setting_flags, positive_int
from outbox.cli.run import print_json, run_async
from outbox.connections import command_transaction
from outbox.errors import ConfigurationError, OutboxError
from outbox.operator import dlq, dlq_discard, render
from outbox.operator.input import discard_reason
from outbox.operator.views import (
    DeadLetterView,
    dead_letter_views,
    dead_letter_views_without_database,
)
from outbox.settings import Settings
from outbox.store import Store

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def cmd_dlq_list(args: argparse.Namespace, settings: Settings) -> int:
    listing = run_async(dlq.list_dead_letters(settings, limit=args.limit))
    now = datetime.now(UTC)
    views = _dead_letter_views(settings, listing.messages)
    if args.json:
        print_json(render.dead_letters_json(listing, views, now))
    else:
        print(render.dead_letters_text(listing, views, now))
    return 0


def _dead_letter_views(
    settings: Settings, messages: Sequence[dlq.DeadLetter]
) -> list[DeadLetterView]:
    """The messages with their operations, as the console's dead-letter page reads them;
    the broker's view alone (and a line on stderr) when the operations cannot be read."""
    if not any(message.parsed for message in messages):
        return [dead_letter_views_without_database(m) for m in messages]
    try:
        with command_transaction(settings) as connection:
            connection.read_only = True
            return dead_letter_views(Store(connection), messages)
    except (OutboxError, psycopg.Error) as error:
        print(
            f"outbox dlq: the operations could not be read ({type(error).__name__}); "
            "showing what the broker holds",
            file=sys.stderr,
        )
        return [dead_letter_views_without_database(m) for m in messages]


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


def cmd_dlq_discard(args: argparse.Namespace, settings: Settings) -> int:
    # Everything a person typed is judged before a message is taken.
    reason = discard_reason(args.reason)
    by = args.by.strip()
    if not by:
        raise ConfigurationError("--by must name the person discarding")
    selection = dlq_discard.Selection.of(
        message_ids=args.message_ids,
        malformed=args.malformed,
        tool=args.tool,
        death_reason=args.death_reason,
    )
    report = run_async(
        dlq_discard.discard_dead_letters(
            settings,
            selection,
            record=dlq_discard.recorder(settings) if args.yes else None,
            reason=reason,
            by=by,
            limit=args.limit,
        )
    )
    views = _dead_letter_views(settings, [c.letter for c in report.selected])
    if args.json:
        print_json(dlq_discard.report_json(report, views))
    else:
        print(dlq_discard.report_text(report, views))
    return 0


def cmd_dlq_discarded(args: argparse.Namespace, settings: Settings) -> int:
    with command_transaction(settings) as connection:
        connection.read_only = True
        records = Store(connection).run(store.list_discarded_dead_letters(args.limit))
    if args.json:
        print_json([dlq_discard.record_json(record) for record in records])
    else:
        print(dlq_discard.records_text(records))
    return 0


def configure_dlq(commands: Commands) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "dlq",
        help="list, requeue or discard the messages in the dead-letter queue",
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
    _configure_discard(actions)


def _configure_discard(actions: Commands) -> None:
    discard = actions.add_parser(
        "discard",
        help="remove dead letters that can never run, each recorded first",
        description="Remove the selected messages from the dead-letter queue: each is "
        "recorded in Postgres (its body's SHA-256 and size, never the body; why it died; "
        "your reason and name) and removed only once the record is committed. Without "
        "--yes, a dry run: what would be discarded, all left in the queue. No operation "
        "is lost: the output says what becomes of each message's operation. The record: "
        "`outbox dlq discarded`.",
    )
    add_setting_flags(discard, "amqp_url", "dead_letter_queue", "database_url")
    discard.add_argument(
        "--message-id",
        dest="message_ids",
        action="extend",
        nargs="+",
        metavar="ID",
        help="only messages with these ids (repeatable)",
    )
    discard.add_argument(
        "--malformed",
        action="store_true",
        help="only bodies that are not an operation envelope (a consumer can never run them)",
    )
    discard.add_argument("--tool", help="only envelopes whose every operation is of this tool")
    discard.add_argument(
        "--death-reason",
        choices=dlq_discard.DEATH_REASONS,
        help="only messages RabbitMQ dead-lettered for this reason (x-death)",
    )
    discard.add_argument(
        "--reason", required=True, help="why these messages can go (kept in the record)"
    )
    discard.add_argument("--by", required=True, help="who discards (name or email)")
    discard.add_argument(
        "--yes", action="store_true", help="discard; without it, only show what would go"
    )
    discard.add_argument(
        "--limit", type=positive_int, help="discard at most N messages (default: no limit)"
    )
    discard.add_argument("--json", action="store_true", help="one JSON document instead of text")
    discard.set_defaults(handler=cmd_dlq_discard)
    discarded = actions.add_parser(
        "discarded",
        help="the record of discarded dead letters, newest first",
        description="Every dead letter discarded with `outbox dlq discard` or the console: "
        "when, by whom (the person and the database login), why, and what it was (body "
        "SHA-256 and size, operations, tools, when and why it died).",
    )
    add_setting_flags(discarded, "database_url")
    discarded.add_argument(
        "--limit",
        type=positive_int,
        default=dlq.DEFAULT_LIST_LIMIT,
        help=f"show at most N records (default {dlq.DEFAULT_LIST_LIMIT})",
    )
    discarded.add_argument("--json", action="store_true", help="one JSON document instead of text")
    discarded.set_defaults(handler=cmd_dlq_discarded)
