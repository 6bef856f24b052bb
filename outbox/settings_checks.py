"""The settings that are wrong only together: each check returns its problems as whole
sentences naming the variables, for :class:`outbox.settings.Settings` to refuse at once."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

from outbox.variables import setting_variable


def bounds_past_the_lease(margin: float, bounds: Mapping[str, float | None]) -> list[str]:
    """Each database-session bound (by setting name) must end before the lease does."""
    problems = []
    for name, bound in bounds.items():
        if bound is None or bound < margin:
            continue  # unset, each derives from the margin and ends before it
        variable = setting_variable(name)
        problems.append(
            f"{setting_variable('lease_margin')} ({margin:g} s) must be longer than "
            f"{variable} ({bound:g} s): a database session could otherwise still hold "
            "an operation's row after its lease ran out, and the reconciler could not "
            f"take it over; raise {setting_variable('lease_margin')} above {bound:g} s "
            f"or lower {variable} below {margin:g} s (unset, it derives from the margin)"
        )
    return problems


def retry_waits(first: float, longest: float) -> list[str]:
    if longest >= first:
        return []
    return [
        f"{setting_variable('publish_retry_max')} ({longest:g} s) is shorter than "
        f"{setting_variable('publish_retry_initial')} ({first:g} s), the first wait "
        f"before a publish is retried: raise {setting_variable('publish_retry_max')} to "
        f"{first:g} s or more, or lower {setting_variable('publish_retry_initial')}"
    ]


def history_windows(hot: timedelta, kept: timedelta) -> list[str]:
    if hot < kept:
        return []
    return [
        f"{setting_variable('history_hot')} ({hot}) must be less than "
        f"{setting_variable('history_retention')}"
    ]
