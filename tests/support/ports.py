"""Local ports for misconfiguration tests: one nothing listens on, one already taken."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def closed_port() -> int:
    """A local port nothing listens on: bound once to find it free, then released."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A local port another process's socket holds for the length of the block."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])
