"""Group commit for the consumer: the deliveries in hand share one transaction."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


class Batcher(Generic[ItemT, ResultT]):
    """Group commit: what is submitted while a flush runs goes together into the next.

    A flush of one item starts as soon as one is submitted, so an idle consumer adds no
    wait; under load each flush takes everything that queued up meanwhile (up to
    ``limit``, read at each flush when it is a callable). ``flush`` returns one result
    per item, in order. A flush that raises raises in every submitter of its batch, and
    one that is cancelled cancels them.
    """

    def __init__(
        self,
        flush: Callable[[list[ItemT]], Awaitable[list[ResultT]]],
        *,
        limit: int | Callable[[], int],
    ) -> None:
        self._flush = flush
        # A callable is read at each flush: the consumer's backpressure narrows bursts.
        self._limit = limit
        self._queue: list[tuple[ItemT, asyncio.Future[ResultT]]] = []
        self._running: asyncio.Task[None] | None = None

    async def submit(self, item: ItemT) -> ResultT:
        """``item``'s result, once the flush that took it has run."""
        future: asyncio.Future[ResultT] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        while self._queue:
            limit = max(1, self._limit() if callable(self._limit) else self._limit)
            batch, self._queue = self._queue[:limit], self._queue[limit:]
            try:
                results = await self._flush([item for item, _ in batch])
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as error:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
