"""``outbox callbacks list``: the provider callbacks inbox, for an operator.

``outbox callbacks`` is registered by :mod:`outbox.callbacks.cli`, which keeps ``serve``
beside the web stack and adds this action from here; each callback reads as it does
under ``ops show`` (:func:`outbox.operator.render.callback_json`,
:func:`outbox.operator.render.callbacks_table`).
"""

from __future__ import annotations

import argparse
from typing import TypeAlias

from outbox import store
from outbox.cli.arguments import add_setting_flags, positive_int
from outbox.cli.run import print_json
from outbox.connections import command_transaction
from outbox.operator import render
from outbox.settings import Settings
from outbox.store import Store

Actions: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

DEFAULT_LIST_LIMIT = 50


def configure_callbacks_list(actions: Actions) -> None:
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
    listing.set_defaults(handler=cmd_callbacks_list)


def cmd_callbacks_list(args: argparse.Namespace, settings: Settings) -> int:
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
        print_json([render.callback_json(c) for c in callbacks])
    else:
        print(render.callbacks_listing_text(callbacks))
    return 0
