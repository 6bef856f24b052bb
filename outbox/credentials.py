"""Tokens that name who presents them, for the servers that take requests: ``outbox mcp``
over HTTP (its callers) and ``outbox console`` (its operators).

Both read a ``name:token[,name:token...]`` list from one environment variable (never a
flag: ``ps`` shows flags to every user of the machine), compare a presented token with
every configured one in constant time, and count failed attempts per client address.
An error names the variable and the entry's position, never what the entry holds.
"""

from __future__ import annotations

import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from outbox.errors import ConfigurationError


@dataclass(frozen=True)
class Credential:
    name: str
    token: str = field(repr=False)


def parse_credentials(
    text: str,
    *,
    variable: str,
    min_length: int,
    name: Callable[[str], str],
    kind: str = "token",
    hint: str = " (`openssl rand -base64 32` makes one)",
) -> tuple[Credential, ...]:
    """The ``name:<kind>`` entries of ``text`` (separated by commas). ``name`` checks and
    returns an entry's name, or raises ConfigurationError saying what a name must be."""
    credentials: list[Credential] = []
    for number, entry in enumerate(part for part in text.split(",") if part.strip()):
        given, colon, token = entry.strip().partition(":")
        # Errors say which entry, never what it holds: it is a secret.
        where = f"{variable} entry {number + 1}"
        if not colon:
            raise ConfigurationError(f"{where} is not name:{kind}")
        try:
            checked = name(given)
        except ConfigurationError as error:
            raise ConfigurationError(f"{where}: {error}") from None
        if len(token) < min_length or token != token.strip():
            raise ConfigurationError(
                f"{where}: the {kind} must be at least {min_length} characters, without "
                f"surrounding spaces{hint}"
            )
        if any(c.token == token for c in credentials):
            raise ConfigurationError(f"{where}: two entries share one {kind}")
        credentials.append(Credential(name=checked, token=token))
    return tuple(credentials)


def credential_for(credentials: Iterable[Credential], token: bytes | str) -> Credential | None:
    """The credential whose token this is. Every credential is compared, in constant
    time each, so the time taken says nothing about which one came close."""
    found = None
    given = token.encode() if isinstance(token, str) else token
    for credential in credentials:
        if hmac.compare_digest(credential.token.encode(), given):
            found = credential
    return found


# Refused attempts an address may make in a window before its attempts are refused
# unread: enough for a person's typos, far too few to guess even a short token.
FAILURES = 10
WINDOW_SECONDS = 600.0
MAX_ADDRESSES = 10_000


class FailureThrottle:
    """Counts refused attempts per client address. An address past ``limit`` failures in
    ``window`` seconds has every attempt refused, right or wrong, until the window since
    its first failure has passed: a guess then tells the guesser nothing. At most
    ``addresses`` are remembered (the oldest are forgotten first), so a flood of
    addresses cannot grow it without bound."""

    def __init__(
        self,
        *,
        limit: int = FAILURES,
        window: float = WINDOW_SECONDS,
        addresses: int = MAX_ADDRESSES,
    ) -> None:
        self._limit = limit
        self._window = window
        self._addresses = addresses
        # address -> (failures, when the first of them was)
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def _current(self, address: str) -> int:
        found = self._failures.get(address)
        if found is None:
            return 0
        if found[1] + self._window <= time.monotonic():
            del self._failures[address]
            return 0
        return found[0]

    def blocked(self, address: str) -> bool:
        return self._current(address) >= self._limit

    def retry_after(self, address: str) -> int:
        """Whole seconds until ``address`` may try again (0 when it may now)."""
        if not self.blocked(address):
            return 0
        first = self._failures[address][1]
        return max(1, math.ceil(first + self._window - time.monotonic()))

    def failed(self, address: str) -> int:
        """Count a refused attempt; the address's failures in its window so far."""
        count = self._current(address)
        started = self._failures[address][1] if count else time.monotonic()
        self._failures[address] = (count + 1, started)
        while len(self._failures) > self._addresses:
            self._failures.popitem(last=False)
        return count + 1
