"""Recording a decision whole when the caller may be cancelled, within a deadline.

An agent's tool call can be cancelled at any moment: a client's timeout, a sibling call
that failed, a run stopped. A cancellation that cut the decision's transaction in half
would leave the caller unsure whether it was recorded, and would hand a connection back
to the pool halfway through its commit. So the transaction runs in a task of its own,
which the caller's cancellation does not reach: the caller waits for it to end, then
stays cancelled, and a retry with the same decision key finds the decision.

The wait is bounded: the transaction's connection is cut at the deadline
(:func:`outbox.connections.bounded_transaction`), and a cancelled caller waits no longer
than that, so a database that does not answer cannot hold a cancelled call. The agent
adapters (``outbox mcp``, the pydantic-ai toolset) both record this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import store
from outbox.bounds import DECISION_LOCK_TIMEOUT
from outbox.connections import bounded_transaction
from outbox.models import RecordedDecision
from outbox.store import AsyncStore, NewDecision

# How long past the deadline a cancelled caller still waits: the cut itself (closing the
# socket, the driver raising) takes a moment.
CUT_MARGIN_SECONDS = 1.0


async def record_decision_whole(
    engine: AsyncEngine,
    decision: NewDecision,
    *,
    seconds: float,
    lock_timeout: float = DECISION_LOCK_TIMEOUT,
) -> RecordedDecision:
    """Record ``decision`` (validated already: :func:`outbox.intent.prepare_decision`)
    in a transaction of its own on ``engine``, cut if it takes longer than ``seconds``
    (:class:`~outbox.connections.TransactionDeadlineExceeded`); the insert waits at
    most ``lock_timeout`` seconds for a lock (``LockNotAvailable``, nothing written).

    If the caller is cancelled meanwhile, the transaction still ends, committed or
    rolled back whole, and the caller waits for that up to the deadline before its
    cancellation goes on; past it, the transaction ends on its own in the background."""
    give_up_at = time.monotonic() + seconds + CUT_MARGIN_SECONDS
    recording = asyncio.ensure_future(_record(engine, decision, seconds, lock_timeout))
    try:
        return await asyncio.shield(recording)
    except asyncio.CancelledError:
        # anyio cancels again on every turn of the loop until the task leaves its
        # scope, and asyncio's task.cancel() once: either way the wait goes on.
        while not recording.done() and (remaining := give_up_at - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([recording], timeout=remaining)
        recording.add_done_callback(_retrieve_quietly)
        raise


async def _record(
    engine: AsyncEngine, decision: NewDecision, seconds: float, lock_timeout: float
) -> RecordedDecision:
    async with bounded_transaction(engine, seconds) as connection:
        return await (await AsyncStore.on(connection)).run(
            store.record_decision(decision, lock_timeout=lock_timeout)
        )


def _retrieve_quietly(recording: asyncio.Future[RecordedDecision]) -> None:
    # The call that wanted the result was cancelled: nobody is left to hear of an error.
    if not recording.cancelled():
        recording.exception()
