"""How long to wait before trying again: exponential delays with jitter, so a peer
that is down is not hammered and many processes do not retry in lockstep. Used by
both daemons' reconnects and by the outcome watcher."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Reconnect delays: 0.2 s doubling to 10 s, reset by a session that lived 10 s.
FIRST_RETRY_SECONDS = 0.2
LONGEST_RETRY_SECONDS = 10.0
HEALTHY_SESSION_SECONDS = 10.0


def jittered(seconds: float) -> float:
    """``seconds`` spread by +-50%, so many processes do not retry in lockstep."""
    return seconds * random.uniform(0.5, 1.5)  # noqa: S311 - spreading retries, not crypto


@dataclass
class Backoff:
    """Exponential delays with jitter between attempts. A session that lived at least
    ``healthy_after`` seconds starts the count again; one that dies at once doubles the
    next wait, so a daemon never reconnects in a tight loop."""

    first: float = FIRST_RETRY_SECONDS
    longest: float = LONGEST_RETRY_SECONDS
    healthy_after: float = HEALTHY_SESSION_SECONDS
    failures: int = field(default=0, init=False)

    def next_delay(self, *, session_lasted: float = 0.0) -> float:
        if session_lasted >= self.healthy_after:
            self.failures = 0
        self.failures += 1
        return jittered(min(self.longest, self.first * 2 ** min(self.failures - 1, 32)))

    def reset(self) -> None:
        self.failures = 0
