"""Waiting for a condition with a deadline: the only way tests wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

POLL_SECONDS = 0.02


async def eventually(condition: Callable[[], Awaitable[bool]], *, within: float, what: str) -> None:
    """Return as soon as ``condition()`` holds; fail naming ``what`` after ``within`` s."""
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {within:g}s: {what}")
        await asyncio.sleep(POLL_SECONDS)


def eventually_sync(condition: Callable[[], bool], *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {within:g}s: {what}")
        time.sleep(POLL_SECONDS)
