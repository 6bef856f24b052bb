"""The argument types and flags every ``outbox`` command shares, so that one flag means
one thing wherever it appears (as celery's ``bin/base.py`` holds its argument types).

A flag that maps to a setting is generated from :class:`Settings` (:func:`add_setting_flags`),
so its help always names its ``OUTBOX_*`` variable and the two cannot drift apart. The
setting flags the generator cannot express (a switch, a repeatable list) are here too.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from pydantic import SecretStr

from outbox.loading import TOOLS_ENV
from outbox.models import parse_operation_id
from outbox.settings import ENV_PREFIX, Settings, load_settings
from outbox.urls import redact_url


def add_setting_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    """One ``--flag-name`` per setting, each overriding its ``OUTBOX_*`` variable."""
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


def settings_from(args: argparse.Namespace) -> Settings:
    """The environment's settings with every setting flag given on top (None: not given,
    the variable decides)."""
    return load_settings(**{name: getattr(args, name, None) for name in Settings.model_fields})


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


def add_tools_flag(parser: argparse.ArgumentParser, *, used_for: str = "") -> None:
    """``--tools`` as the ``tools`` setting, in every command that loads tools modules:
    comma-separated, repeatable (each use adds to the others), and when given it replaces
    ``OUTBOX_TOOLS`` rather than adding to it, as every setting flag replaces its
    variable. The command reads the modules from ``settings.tools``. ``used_for`` says
    what this command does with them, for its help."""
    purpose = f" ({used_for})" if used_for else ""
    parser.add_argument(
        "--tools",
        dest="tools",
        action=_Joined,
        default=None,
        metavar="MODULE[,MODULE...]",
        help=f"{Settings.model_fields['tools'].description}{purpose}; repeatable "
        f"[env {TOOLS_ENV}; flags replace the variable]",
    )


def add_declare_topology_flag(parser: argparse.ArgumentParser) -> None:
    """``--declare-topology`` as the ``declare_topology`` setting, a switch."""
    parser.add_argument(
        "--declare-topology",
        dest="declare_topology",
        action="store_const",
        const=True,
        default=None,  # None: the variable decides (settings_from)
        help=f"{Settings.model_fields['declare_topology'].description} "
        f"[env {ENV_PREFIX}DECLARE_TOPOLOGY; default false]",
    )


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type for a count: a whole number, 1 or more."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def positive_int_up_to(most: int) -> Callable[[str], int]:
    """argparse type for a count from 1 to ``most``."""

    def bounded(text: str) -> int:
        value = _whole_number(text)
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"must be between 1 and {most}")
        return value

    return bounded


def seconds(text: str) -> float:
    """argparse type for a length of time in seconds: finite, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError("must be a finite number of seconds, 0 or more")
    return value


def positive_seconds(text: str) -> float:
    """argparse type for a wait that must end: seconds, more than 0 (a lock_timeout of
    0 would wait forever) and at most an hour."""
    value = seconds(text)
    if not 0.001 <= value <= 3600:
        raise argparse.ArgumentTypeError("must be between 0.001 and 3600 seconds")
    return value


# Far beyond any sensible grant or look-back; it keeps `now() ± duration` inside what
# Python and Postgres timestamps can hold.
MAX_DURATION = timedelta(days=3650)
_DURATION = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def duration(text: str) -> timedelta:
    """argparse type: ``30s``, ``15m``, ``2h``, ``1d``."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration like 30s, 15m, 2h or 1d: {text!r}")
    try:
        value = timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    except OverflowError:
        value = timedelta.max
    if value <= timedelta(0):
        raise argparse.ArgumentTypeError("a duration must be longer than zero")
    if value > MAX_DURATION:
        raise argparse.ArgumentTypeError(f"a duration must be at most {MAX_DURATION.days}d")
    return value


def since(text: str) -> datetime | timedelta:
    """argparse type for ``--since``: a duration back from now, or an ISO 8601 instant
    (UTC when it names no offset)."""
    if _DURATION.fullmatch(text):
        return duration(text)
    try:
        instant = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time or a duration like 30m, 2h, 1d: {text!r}"
        ) from None
    return instant if instant.tzinfo else instant.replace(tzinfo=UTC)


def operation_id_argument(text: str) -> UUID:
    """argparse type for an operation id: a malformed one is a usage error (exit 2)."""
    try:
        return parse_operation_id(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an operation id: {text!r} (expected op_<uuid> or a bare uuid)"
        ) from None
