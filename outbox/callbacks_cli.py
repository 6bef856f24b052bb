"""``outbox callbacks``: serve the provider callback routes (``serve``), and show the
inbox to an operator (``list``). Imports nothing of the web stack until ``serve`` runs,
so without the ``callbacks`` extra ``list`` still works and ``serve`` says what to
install."""

from __future__ import annotations

import argparse
import json
from typing import Any

from outbox import store
from outbox.cli import add_setting_flags, positive_int
from outbox.connections import command_transaction
from outbox.operator import render
from outbox.settings import Settings
from outbox.store import Store

DEFAULT_LIST_LIMIT = 50


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "callbacks",
        help="provider callbacks: serve their routes, list the inbox",
        description="Provider callbacks (signed webhooks) are evidence about the effects of "
        "tools whose contracts declare them: `serve` verifies and records them, the "
        "consumer's reconciler applies them, `list` shows the inbox.",
    )
    actions = parser.add_subparsers(dest="callbacks_command", required=True, metavar="ACTION")
    from outbox.callbacks_server import add_serve_command

    add_serve_command(actions)

    listing = actions.add_parser(
        "list",
        help="the callbacks inbox, newest first",
        description="One line per callback: its inbox id, provider, event id, what it "
        "reported, the operation it named, the provider's reference, what the reconciler "
        "did with it and when it came. Needs a login that is a member of outbox_operator.",
    )
    add_setting_flags(listing, "database_url")
    which = listing.add_mutually_exclusive_group()
    which.add_argument(
        "--unmatched",
        action="store_true",
        help="only callbacks that named no operation of this database",
    )
    which.add_argument(
        "--contradicted",
        action="store_true",
        help="only callbacks that disagreed with how their operation ended",
    )
    which.add_argument("--pending", action="store_true", help="only callbacks not applied yet")
    listing.add_argument("--provider", help="only this provider's callbacks")
    listing.add_argument(
        "--limit",
        type=positive_int,
        default=DEFAULT_LIST_LIMIT,
        help=f"show at most N callbacks (default {DEFAULT_LIST_LIMIT})",
    )
    listing.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    listing.set_defaults(handler=cmd_list)


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    with command_transaction(settings) as connection:
        callbacks = Store(connection).run(
            store.list_callbacks(
                unmatched=args.unmatched,
                contradicted=args.contradicted,
                pending=args.pending,
                provider=args.provider,
                limit=args.limit,
            )
        )
    if args.json:
        print(json.dumps([render.callback_json(c) for c in callbacks], indent=2))
    else:
        print(render.callbacks_listing_text(callbacks))
    return 0
