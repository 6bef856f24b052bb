"""Backpressure: how much work a daemon takes on at once, narrowed when the database or
the broker struggles and widened again when they keep up.

A retry storm is what turns a slow peer into a failed one: every transaction cut at its
deadline comes back as another, on top of the work that was already too much. An
:class:`AIMDLimit` (additive increase, multiplicative decrease, as TCP's congestion
window) halves the work in hand when a transaction overran its deadline or took a large
share of it, at most once per ``cooldown`` (the failures of one burst are one signal,
not many), and adds one after each full window of healthy transactions. The consumer
applies it as its prefetch (``basic.qos``) and the size of a claim's burst, the
reconciler as its batch, the dispatcher as its batch size. Every limit is exported as a
gauge, so a narrowed daemon is visible before anyone asks why it is slow.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DECREASE_FACTOR = 0.5
# One signal per burst: the failures of deliveries that shared a transaction arrive
# together, and must halve the limit once.
COOLDOWN_SECONDS = 1.0


class AIMDLimit:
    """A limit between ``least`` and ``most``, starting at ``most``.

    :meth:`overloaded` multiplies it by ``factor`` (at most once per ``cooldown``);
    :meth:`succeeded` adds one after ``limit`` successes in a row, so a narrowed daemon
    widens at about one step per window of work, and a healthy one stays at ``most``.
    :meth:`observe` reads a transaction's duration: longer than ``slow_after`` counts
    as overload. ``on_change`` is called with the new limit whenever it moves.
    """

    def __init__(
        self,
        *,
        most: int,
        least: int = 1,
        slow_after: float | None = None,
        factor: float = DECREASE_FACTOR,
        cooldown: float = COOLDOWN_SECONDS,
        on_change: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= least <= most:
            raise ValueError(f"an AIMD limit needs 1 <= least <= most, not {least} and {most}")
        if not 0 < factor < 1:
            raise ValueError(f"a decrease factor is between 0 and 1, not {factor}")
        self.least = least
        self.most = most
        self.slow_after = slow_after
        self.factor = factor
        self.cooldown = cooldown
        self._on_change = on_change
        self._clock = clock
        self._limit = most
        self._successes = 0
        self._last_decrease: float | None = None
        self.decreases = 0
        """How many times the limit was narrowed (tests and logs)."""

    @property
    def limit(self) -> int:
        return self._limit

    def overloaded(self) -> bool:
        """A deadline hit, a transaction too slow, a peer away: narrow. Returns whether
        the limit moved (not within the cooldown of the last decrease, not below
        ``least``)."""
        self._successes = 0
        now = self._clock()
        if self._last_decrease is not None and now - self._last_decrease < self.cooldown:
            return False
        self._last_decrease = now
        narrowed = max(self.least, int(self._limit * self.factor))
        if narrowed == self._limit:
            return False
        self.decreases += 1
        self._set(narrowed)
        return True

    def succeeded(self) -> bool:
        """A transaction that kept up; returns whether the limit widened."""
        if self._limit >= self.most:
            return False
        self._successes += 1
        if self._successes < self._limit:
            return False
        self._successes = 0
        self._set(self._limit + 1)
        return True

    def observe(self, seconds: float) -> bool:
        """A transaction that took ``seconds``: too slow is overload, else a success.
        Returns whether the limit moved."""
        if self.slow_after is not None and seconds > self.slow_after:
            return self.overloaded()
        return self.succeeded()

    def _set(self, limit: int) -> None:
        self._limit = limit
        if self._on_change is not None:
            self._on_change(limit)
