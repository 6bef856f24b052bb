"""May this deduplicated write be replayed now? One answer for every part that asks.

A deduplicated write's target answers a replayed idempotency key with the outcome of
the first request that carried it, but only while it remembers the key: its dedupe
window. Calling the tool again under the same key is therefore safe only if the whole
call ends inside that window. The consumer asks before it retries an unknown outcome
and again when it claims a replay; ``outbox ops resolve --not-committed`` and the
console's "retry" ask before they queue one more attempt. They all ask
:func:`replay_window_passed`, so they cannot disagree about the margins.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from outbox.contracts import SideEffect, ToolContract
from outbox.models import Operation


def replay_window_passed(
    operation: Operation,
    contract: ToolContract[Any],
    *,
    now: datetime,
    after: timedelta = timedelta(0),
) -> bool:
    """Whether a call of ``operation`` starting ``after`` from ``now`` could reach its
    target once the target may have forgotten the key.

    The margins: the call may run a whole ``contract.deadline``, so it must *end* inside
    the window; the window is counted from the first attempt (the first claim, which
    comes before the target first saw the key, so the estimate ends early rather than
    late), or from the decision when an attempt is counted without its time. An
    operation never attempted has sent no key, so there is nothing to replay. Only a
    deduplicated write has a window: every other class is as safe (or as unsafe) to
    repeat at any time.
    """
    if contract.side_effect is not SideEffect.DEDUPLICATED_WRITE or operation.attempts == 0:
        return False
    assert contract.dedupe_window is not None  # the registry refuses a dedupe write without one
    first = operation.first_attempt_at or operation.created_at
    return now + after + contract.deadline >= first + contract.dedupe_window
