"""``outbox callbacks``: serve the provider callback routes (``serve``), and show the
inbox to an operator (``list``). Imports nothing of the web stack until ``serve`` runs,
so without the ``callbacks`` extra ``list`` still works and ``serve`` says what to
install."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from outbox import store
from outbox.cli import add_setting_flags, positive_int
from outbox.connections import command_transaction
from outbox.models import Callback, display_operation_id
from outbox.operator.render import instant, stamp, table
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


def _operation(callback: Callback) -> str:
    if callback.operation_id is not None:
        return display_operation_id(callback.operation_id)
    if callback.named_operation_id is not None:
        return f"{display_operation_id(callback.named_operation_id)} (unknown)"
    return "-"


def callback_json(callback: Callback) -> dict[str, Any]:
    def shown(operation_id: Any) -> str | None:
        return display_operation_id(operation_id) if operation_id is not None else None

    return {
        "id": callback.id,
        "provider": callback.provider,
        "event_id": callback.event_id,
        "status": str(callback.status),
        "operation_id": shown(callback.operation_id),
        "named_operation_id": shown(callback.named_operation_id),
        "provider_reference": callback.provider_reference,
        "payload_digest": callback.payload_digest,
        "received_at": instant(callback.received_at),
        "outcome": str(callback.outcome) if callback.outcome else None,
        "applied_at": instant(callback.applied_at),
    }


def listing_text(callbacks: Sequence[Callback]) -> str:
    if not callbacks:
        return "no callbacks match"
    rows = [
        [
            str(c.id),
            c.provider,
            c.event_id,
            str(c.status),
            _operation(c),
            c.provider_reference or "-",
            str(c.outcome) if c.outcome else "not applied yet",
            stamp(c.received_at),
        ]
        for c in callbacks
    ]
    headers = ["ID", "PROVIDER", "EVENT", "STATUS", "OPERATION", "REFERENCE", "OUTCOME", "RECEIVED"]
    return table(headers, rows)


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
        print(json.dumps([callback_json(c) for c in callbacks], indent=2))
    else:
        print(listing_text(callbacks))
    return 0
