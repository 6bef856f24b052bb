"""Sessions, identity and CSRF for the console.

A session is a random id in an HttpOnly, SameSite=Strict cookie, mapped in memory to
the operator it authenticated and a CSRF token of its own. Every state-changing request
must carry that token in its form (:func:`check_csrf`); sessions die with the process,
so a restart logs everyone out, which is the safe direction.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from outbox import credentials
from outbox.console.config import AuthConfig, Credential, operator_name
from outbox.credentials import FailureThrottle
from outbox.errors import ConfigurationError

COOKIE = "outbox_console_session"
CSRF_FIELD = "csrf_token"
SESSION_SECONDS = 8 * 3600
# A login form left open longer than this is reloaded before it is submitted.
ANONYMOUS_SESSION_SECONDS = 3600
# Anonymous sessions exist only to protect the login form, and anyone who can reach the
# port can make one: their table is bounded on its own, so a flood of unauthenticated
# visits evicts only other anonymous sessions, never an operator's.
MAX_ANONYMOUS_SESSIONS = 10_000
# Only a valid credential (or the trusted proxy) makes one of these.
MAX_OPERATOR_SESSIONS = 1_000


@dataclass
class Session:
    id: str
    csrf: str
    operator: str | None
    """Who this session authenticated; None before login."""
    via_proxy: bool
    expires: float
    notice: str | None = None
    """A one-line confirmation of the last action, shown once on the next page."""


class _Table:
    """Sessions of one kind, oldest first, at most ``limit`` of them."""

    def __init__(self, lifetime: float, limit: int) -> None:
        self.lifetime = lifetime
        self.limit = limit
        self.sessions: OrderedDict[str, Session] = OrderedDict()

    def make_room(self) -> None:
        now = time.monotonic()
        # The expired go first; only a table full of live sessions loses its oldest.
        for session_id in [k for k, s in self.sessions.items() if s.expires <= now]:
            del self.sessions[session_id]
        while len(self.sessions) >= self.limit:
            self.sessions.popitem(last=False)


class Sessions:
    def __init__(
        self,
        *,
        lifetime: float = SESSION_SECONDS,
        limit: int = MAX_OPERATOR_SESSIONS,
        anonymous_lifetime: float = ANONYMOUS_SESSION_SECONDS,
        anonymous_limit: int = MAX_ANONYMOUS_SESSIONS,
    ) -> None:
        self._operators = _Table(lifetime, limit)
        self._anonymous = _Table(min(anonymous_lifetime, lifetime), anonymous_limit)

    def new(self, operator: str | None, *, via_proxy: bool = False) -> Session:
        table = self._anonymous if operator is None else self._operators
        table.make_room()
        session = Session(
            id=secrets.token_urlsafe(32),
            csrf=secrets.token_urlsafe(32),
            operator=operator,
            via_proxy=via_proxy,
            expires=time.monotonic() + table.lifetime,
        )
        table.sessions[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        for table in (self._operators, self._anonymous):
            session = table.sessions.get(session_id)
            if session is None:
                continue
            if session.expires <= time.monotonic():
                del table.sessions[session_id]
                return None
            return session
        return None

    def end(self, session_id: str | None) -> None:
        if session_id:
            self._operators.sessions.pop(session_id, None)
            self._anonymous.sessions.pop(session_id, None)


# The console's throttle: ten refused logins from one address within ten minutes hold
# that address back for the rest of the ten minutes (outbox.credentials).
LoginThrottle = FailureThrottle


def credential_for(auth: AuthConfig, token: str) -> Credential | None:
    """The operator whose token this is (compared with every one, in constant time)."""
    return credentials.credential_for(auth.credentials, token)


def identity_header(raw_headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    """The single value of the identity header ``name``; None when it is absent or
    ambiguous. Ambiguous is: sent more than once (a proxy that appends rather than
    replaces would put the client's copy first), or alongside a look-alike name that
    differs only in ``_`` for ``-`` (servers and proxies disagree on whether those are
    one header, so one of them may have let the client's copy through). Names compare
    without case, as HTTP says they do."""
    wanted = name.lower().encode("latin-1")
    alike = wanted.replace(b"-", b"_")
    values: list[bytes] = []
    for key, value in raw_headers:
        key = key.lower()
        if key == wanted:
            values.append(value)
        elif key.replace(b"-", b"_") == alike:
            return None
    if len(values) != 1:
        return None
    return values[0].decode("latin-1")


def proxy_operator(auth: AuthConfig, client: str | None, header_value: str | None) -> str | None:
    """The operator a trusted proxy names; None unless the request came from one of the
    configured proxy addresses and carries a valid name in the configured header."""
    if auth.proxy is None or header_value is None or not auth.proxy.trusts(client):
        return None
    if "," in header_value:
        # Two values joined by an intermediary (RFC 9110 folds repeated headers with a
        # comma): which one the proxy set cannot be told, so neither is believed.
        return None
    try:
        return operator_name(header_value)
    except ConfigurationError:
        return None


def check_csrf(session: Session | None, submitted: object) -> bool:
    return (
        session is not None
        and isinstance(submitted, str)
        and hmac.compare_digest(session.csrf.encode(), submitted.encode())
    )
