"""How long to wait before trying again: exponential delays with jitter, so a peer
that is down is not hammered and many processes do not retry in lockstep.

One formula (:func:`exponential_delay`) for every backoff: both daemons' reconnects,
the outcome watcher, the consumer's holds and reconciler passes (through
:class:`Backoff`), and the dispatcher's failed publishes."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# Reconnect delays: 0.2 s doubling to 10 s, reset by a session that lived 10 s.
FIRST_RETRY_SECONDS = 0.2
LONGEST_RETRY_SECONDS = 10.0
HEALTHY_SESSION_SECONDS = 10.0
# Each delay is drawn from +-50% around its nominal value.
JITTER = 0.5


def jittered(seconds: float, *, jitter: float = JITTER, rng: random.Random | None = None) -> float:
    """``seconds`` spread by +-``jitter`` (a fraction), so many processes do not retry
    in lockstep."""
    return seconds * (rng or random).uniform(1.0 - jitter, 1.0 + jitter)


def exponential_delay(
    failures: int,
    *,
    first: float,
    longest: float,
    multiplier: float = 2.0,
    jitter: float = JITTER,
    rng: random.Random | None = None,
) -> float:
    """The wait after ``failures`` (>= 1) failures in a row: ``first``, growing
    ``multiplier`` times per failure up to ``longest``, spread by +-``jitter``."""
    exponent = max(0, failures - 1)
    if multiplier > 1.0 and longest > first > 0:
        # Past this exponent the delay is capped anyway; stopping there keeps
        # multiplier ** exponent from overflowing after very many failures.
        exponent = min(exponent, math.ceil(math.log(longest / first, multiplier)))
    return jittered(min(longest, first * multiplier**exponent), jitter=jitter, rng=rng)


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
        return exponential_delay(self.failures, first=self.first, longest=self.longest)

    def reset(self) -> None:
        self.failures = 0
