"""``outbox callbacks``: serve the provider callback routes (``serve``), and show the
inbox to an operator (``list``, :mod:`outbox.operator.callbacks_commands`). Imports
nothing of the web stack until ``serve`` runs, so without the ``callbacks`` extra
``list`` still works and ``serve`` says what to install."""

from __future__ import annotations

import argparse
from typing import Any

from outbox.operator.callbacks_commands import configure_callbacks_list


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "callbacks",
        help="provider callbacks: serve their routes, list the inbox",
        description="Provider callbacks (signed webhooks) are evidence about the effects of "
        "tools whose contracts declare them: `serve` verifies and records them, the "
        "consumer's reconciler applies them, `list` shows the inbox.",
    )
    actions = parser.add_subparsers(dest="callbacks_command", required=True, metavar="ACTION")
    from outbox.callbacks.server import add_serve_command

    add_serve_command(actions)
    configure_callbacks_list(actions)
