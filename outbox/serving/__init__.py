"""The serving layer of the three network front ends (``outbox callbacks serve``,
``outbox console``, ``outbox mcp --transport http``): what each writes once here rather
than for itself.

- :class:`Limits`: what one client may hold of a server, and for how long (the
  ``OUTBOX_SERVE_*`` settings and each front end's body limit).
- :func:`add_bind_flags`, :func:`check_port`: ``--host`` and ``--port``.
- :func:`needs_extra`: the optional-dependency guard, one message for every front end.
- :mod:`outbox.serving.server`: uvicorn on a socket bound before it starts, with the
  limits enforced (:mod:`outbox.serving.protocol`, :mod:`outbox.serving.body`) and
  SIGTERM/SIGINT handled as the daemons handle them.

This module imports nothing of the web stack, so that a command can name what to
install when it is missing.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from outbox.errors import ConfigurationError
from outbox.settings import Settings, settings_in


@dataclass(frozen=True)
class Limits:
    """What one client may hold of a server: the head and body deadlines (seconds), the
    largest body read, the connections held at once, and the grace requests in hand get
    when the server is stopped."""

    max_body: int
    header_seconds: float
    body_seconds: float
    max_connections: int
    grace_seconds: float

    @classmethod
    def from_settings(cls, settings: Settings, *, max_body: int) -> Limits:
        return cls(
            max_body=max_body,
            header_seconds=settings.serve_header_timeout,
            body_seconds=settings.serve_body_timeout,
            max_connections=settings.serve_max_connections,
            grace_seconds=settings.serve_grace,
        )

    @classmethod
    def defaults(cls, *, max_body: int) -> Limits:
        """The settings' defaults, whatever the environment says (tests, screenshots)."""
        return cls.from_settings(Settings.model_construct(), max_body=max_body)


# The settings every front end takes as flags, after its own body limit.
SERVING_SETTINGS = settings_in("serving")


def add_bind_flags(
    parser: argparse.ArgumentParser,
    host: str,
    port: int,
    *,
    unset: bool = False,
    prefix: str = "",
    host_note: str = "",
) -> None:
    """``--host`` and ``--port`` with ``host`` and ``port`` as their defaults; with
    ``unset`` the parser leaves them None (the flags apply to one transport only, and the
    command tells given from not given) and the help still names the defaults."""
    parser.add_argument(
        "--host",
        default=None if unset else host,
        help=f"{prefix}address to bind{host_note} [{host}]",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None if unset else port,
        help=f"{prefix}port to bind, 0 for any free one [{port}]",
    )


def check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigurationError(f"--port {port} is not a port: give 0 to 65535 (0: any free one)")


@contextlib.contextmanager
def needs_extra(command: str, extra: str, what: str = "its web stack") -> Iterator[None]:
    """Turn an ImportError inside into one line that names the missing module and the
    extra to install."""
    try:
        yield
    except ImportError as missing:
        name = getattr(missing, "name", None) or "?"
        raise ConfigurationError(
            f"`{command}` needs {what} ({name} is not installed): pip install "
            f"'effect-outbox[{extra}]'"
        ) from None
