"""Daemon flags that the generated setting flags (``outbox.cli.add_setting_flags``, one
value per flag) cannot express: a switch that takes no value, and a repeatable list."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from outbox.loading import TOOLS_ENV
from outbox.settings import ENV_PREFIX, Settings


class _Joined(argparse.Action):
    """Each use adds its comma-separated value to the ones before, instead of replacing
    them: ``--tools a --tools b`` means both."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        given = [getattr(namespace, self.dest, None), values]
        setattr(namespace, self.dest, ",".join(str(value) for value in given if value))


def add_tools_flag(parser: argparse.ArgumentParser) -> None:
    """``--tools`` as the ``tools`` setting, repeatable."""
    parser.add_argument(
        "--tools",
        dest="tools",
        action=_Joined,
        default=None,
        metavar="MODULE[,MODULE...]",
        help=f"{Settings.model_fields['tools'].description}; repeatable "
        f"[env {TOOLS_ENV}; flags replace the variable]",
    )


def add_declare_topology_flag(parser: argparse.ArgumentParser) -> None:
    """``--declare-topology`` as the ``declare_topology`` setting, a switch."""
    parser.add_argument(
        "--declare-topology",
        dest="declare_topology",
        action="store_const",
        const=True,
        default=None,  # None: the variable decides (see outbox.cli._settings_from)
        help=f"{Settings.model_fields['declare_topology'].description} "
        f"[env {ENV_PREFIX}DECLARE_TOPOLOGY; default false]",
    )
