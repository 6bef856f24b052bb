"""Signal handling shared by the daemons: the first SIGTERM or SIGINT asks for a graceful
stop, a second one exits at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable

from outbox.logs import log_fields

logger = logging.getLogger(__name__)


async def run_until_signalled(
    name: str, run: Callable[[], Awaitable[None]], stop: Callable[[], None], *, finishing: str
) -> None:
    """Run ``run()``; on the first signal call ``stop()`` (``finishing`` says what the
    daemon still does), on a second one exit with status 1 without waiting."""
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        signal_name = signal.Signals(signum).name
        if signals_seen > 1:
            log_fields(
                logger,
                logging.WARNING,
                f"{name}.killed",
                "second signal, exiting now",
                signal=signal_name,
            )
            os._exit(1)
        log_fields(logger, logging.INFO, f"{name}.stopping", finishing, signal=signal_name)
        stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await run()


class Stoppable:
    """The stop switch both daemons share: ``stop()`` asks, loops check ``stopping``,
    and every wait is cut short by a stop instead of running out its time."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """Finish the work in hand, then return from ``run()``."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def wait_for_stop(self) -> None:
        await self._stop.wait()

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake up at once when stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
