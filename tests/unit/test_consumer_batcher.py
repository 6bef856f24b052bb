"""The consumer's group commit: bursts share one flush, failures reach every submitter."""

from __future__ import annotations

import asyncio

import pytest

from consumer.batching import Batcher


async def test_what_queues_during_a_flush_goes_together_into_the_next() -> None:
    flushed: list[list[int]] = []
    first_flush_started = asyncio.Event()
    gate = asyncio.Event()

    async def flush(items: list[int]) -> list[int]:
        flushed.append(items)
        if len(flushed) == 1:
            first_flush_started.set()
            await gate.wait()
        return [item * 10 for item in items]

    batcher = Batcher(flush, limit=3)
    first = asyncio.ensure_future(batcher.submit(1))
    await first_flush_started.wait()  # the first flush holds one item, waiting at the gate
    rest = [asyncio.ensure_future(batcher.submit(n)) for n in range(2, 7)]
    await asyncio.sleep(0)  # one loop turn: the five submitters queue their items
    gate.set()

    assert await asyncio.gather(first, *rest) == [10, 20, 30, 40, 50, 60]
    assert flushed == [[1], [2, 3, 4], [5, 6]]


async def test_a_failed_flush_fails_every_submitter_of_its_batch_only() -> None:
    async def flush(items: list[int]) -> list[int]:
        if 2 in items:
            raise RuntimeError("database gone")
        return items

    batcher = Batcher(flush, limit=2)
    results = await asyncio.gather(*(batcher.submit(n) for n in (1, 2, 3)), return_exceptions=True)

    assert [type(r) for r in results[:2]] == [RuntimeError, RuntimeError]
    assert results[2] == 3
    assert await batcher.submit(4) == 4


async def test_a_cancelled_flush_cancels_its_submitters() -> None:
    started = asyncio.Event()
    flushing: list[asyncio.Task[object]] = []

    async def flush(items: list[int]) -> list[int]:
        task = asyncio.current_task()
        assert task is not None
        flushing.append(task)
        started.set()
        await asyncio.Event().wait()
        return items

    batcher = Batcher(flush, limit=4)
    waiting = asyncio.ensure_future(batcher.submit(1))
    await started.wait()
    flushing[0].cancel()  # as when the loop shuts down under a running flush

    with pytest.raises(asyncio.CancelledError):
        await waiting
