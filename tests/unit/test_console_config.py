"""Who may use the console, read from the environment: every refusal names the
variable and never echoes a credential."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from outbox.console.config import (
    HOSTS_ENV,
    LOOPBACK_HOSTS,
    OPERATORS_ENV,
    PROXY_HEADER_ENV,
    TRUSTED_PROXIES_ENV,
    auth_from_environment,
    is_loopback,
    served_hosts,
)
from outbox.console.security import (
    LoginThrottle,
    Sessions,
    check_csrf,
    credential_for,
    identity_header,
    proxy_operator,
)
from outbox.errors import ConfigurationError

SECRET = "s3cr3t-" + "q" * 20


def test_operators_come_from_name_token_pairs() -> None:
    auth = auth_from_environment({OPERATORS_ENV: f"ada@example.com:{SECRET}, bob:{'t' * 16}"})

    assert [c.name for c in auth.credentials] == ["ada@example.com", "bob"]
    assert credential_for(auth, SECRET) == auth.credentials[0]
    assert credential_for(auth, SECRET[:-1]) is None
    assert credential_for(auth, "") is None
    assert SECRET not in repr(auth)


def test_no_authentication_configured_refuses_to_serve() -> None:
    with pytest.raises(ConfigurationError, match=OPERATORS_ENV):
        auth_from_environment({})


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (f"ada{SECRET}", "is not name:token"),
        ("ada:short-token", "at least 16"),
        (f":{SECRET}", "operator name"),
        (f"ada:{SECRET},bob:{SECRET}", "share one token"),
    ],
)
def test_a_bad_operator_entry_is_refused_without_echoing_it(value: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        auth_from_environment({OPERATORS_ENV: value})

    assert says in str(refused.value)
    assert SECRET not in str(refused.value)
    assert "short-token" not in str(refused.value)


def test_a_proxy_header_needs_the_proxy_addresses() -> None:
    with pytest.raises(ConfigurationError, match="go together"):
        auth_from_environment({PROXY_HEADER_ENV: "X-Forwarded-User"})
    with pytest.raises(ConfigurationError, match="not an IP address"):
        auth_from_environment(
            {PROXY_HEADER_ENV: "X-Forwarded-User", TRUSTED_PROXIES_ENV: "proxy.local"}
        )


def test_the_proxy_is_trusted_only_from_its_addresses() -> None:
    auth = auth_from_environment(
        {PROXY_HEADER_ENV: "X-Forwarded-User", TRUSTED_PROXIES_ENV: "10.0.0.0/24, ::1"}
    )

    assert proxy_operator(auth, "10.0.0.9", "ada") == "ada"
    assert proxy_operator(auth, "::1", "ada") == "ada"
    assert proxy_operator(auth, "10.0.1.9", "ada") is None
    assert proxy_operator(auth, "testclient", "ada") is None
    assert proxy_operator(auth, None, "ada") is None
    assert proxy_operator(auth, "10.0.0.9", None) is None
    assert proxy_operator(auth, "10.0.0.9", "  ") is None
    assert proxy_operator(auth, "10.0.0.9", "ada\x1b[2J") is None


def test_csrf_tokens_belong_to_their_session() -> None:
    sessions = Sessions()
    mine, theirs = sessions.new("ada"), sessions.new("bob")

    assert check_csrf(mine, mine.csrf)
    assert not check_csrf(mine, theirs.csrf)
    assert not check_csrf(mine, None)
    assert not check_csrf(None, mine.csrf)
    assert mine.id != theirs.id
    assert mine.csrf != theirs.csrf


def test_sessions_expire_and_end() -> None:
    sessions = Sessions(lifetime=-1)
    assert sessions.get(sessions.new("ada").id) is None

    sessions = Sessions()
    session = sessions.new("ada")
    assert sessions.get(session.id) is session
    sessions.end(session.id)
    assert sessions.get(session.id) is None
    assert sessions.get("made-up") is None


def test_the_session_table_is_bounded() -> None:
    sessions = Sessions(limit=3, anonymous_limit=3)
    first = sessions.new(None)
    operator = sessions.new("ada")
    for _ in range(3):
        sessions.new(None)
        sessions.new("bob")

    assert sessions.get(first.id) is None
    assert sessions.get(operator.id) is None


def test_a_flood_of_anonymous_sessions_never_evicts_an_operator() -> None:
    # Anyone who can reach the port makes an anonymous session per GET /login.
    sessions = Sessions(limit=3, anonymous_limit=3)
    operator = sessions.new("ada")

    flood = [sessions.new(None) for _ in range(50)]

    assert sessions.get(operator.id) is operator
    assert sessions.get(flood[-1].id) is flood[-1]
    assert sessions.get(flood[0].id) is None


def test_expired_sessions_make_room_before_live_ones_are_evicted() -> None:
    sessions = Sessions(limit=2, anonymous_limit=2, anonymous_lifetime=-1)
    anonymous = [sessions.new(None) for _ in range(5)]
    live = sessions.new("ada")
    sessions.new("bob")

    assert all(sessions.get(s.id) is None for s in anonymous)
    assert sessions.get(live.id) is live


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ([(b"x-forwarded-user", b"ada")], "ada"),
        ([(b"X-FORWARDED-USER", b"ada")], "ada"),  # names are case-insensitive
        ([], None),
        # Sent twice: a proxy that appends would put the client's copy first.
        ([(b"x-forwarded-user", b"mallory"), (b"x-forwarded-user", b"ada")], None),
        # A look-alike that some servers merge with the dashed name, alone or not.
        ([(b"x_forwarded_user", b"mallory"), (b"x-forwarded-user", b"ada")], None),
        ([(b"x-forwarded-user", b"ada"), (b"X_Forwarded-User", b"mallory")], None),
        ([(b"x_forwarded_user", b"mallory")], None),
    ],
)
def test_the_identity_header_counts_only_when_sent_once_under_its_own_name(
    raw: list[tuple[bytes, bytes]], value: str | None
) -> None:
    assert identity_header(raw, "X-Forwarded-User") == value


def test_a_comma_joined_identity_names_nobody() -> None:
    auth = auth_from_environment(
        {PROXY_HEADER_ENV: "X-Forwarded-User", TRUSTED_PROXIES_ENV: "10.0.0.7"}
    )

    assert proxy_operator(auth, "10.0.0.7", "mallory, ada") is None
    assert proxy_operator(auth, "10.0.0.7", "ada") == "ada"


@pytest.mark.parametrize("header", ["X_Forwarded_User", "X-Forwarded-User:", "X Forwarded", "-X"])
def test_a_proxy_header_name_must_be_dashed_letters_and_digits(header: str) -> None:
    with pytest.raises(ConfigurationError, match="letters, digits and dashes"):
        auth_from_environment({PROXY_HEADER_ENV: header, TRUSTED_PROXIES_ENV: "10.0.0.7"})


@pytest.mark.parametrize("proxies", ["0.0.0.0/0", "::/0", "10.0.0.7, ::/0", "0.0.0.0/0.0.0.0"])
def test_a_proxy_network_of_every_address_is_refused(proxies: str) -> None:
    """Every address is no proxy: anyone who reaches the console could name themselves."""
    with pytest.raises(ConfigurationError) as refused:
        auth_from_environment({PROXY_HEADER_ENV: "X-Forwarded-User", TRUSTED_PROXIES_ENV: proxies})

    message = str(refused.value)
    assert message.startswith(f"{TRUSTED_PROXIES_ENV}: ")
    assert "is every address" in message
    assert "name the proxy's own address" in message


@pytest.mark.parametrize(
    "header",
    [
        "Cookie",
        "authorization",
        "Proxy-Authorization",
        "Host",
        "Content-Length",
        "Content-Type",
        "Transfer-Encoding",
        "Connection",
        "Upgrade",
        "TE",
        "X-Forwarded-For",
        "X-Forwarded-Host",
        "Forwarded",
        "X-Real-IP",
        "Via",
        "User-Agent",
        "Referer",
        "Origin",
        "Accept-Language",
        "Sec-Fetch-Site",
        "Proxy-Anything",
        "X-CSRF-Token",
    ],
)
def test_a_header_the_client_or_http_itself_sets_is_refused_as_the_identity_header(
    header: str,
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        auth_from_environment({PROXY_HEADER_ENV: header, TRUSTED_PROXIES_ENV: "10.0.0.7"})

    message = str(refused.value)
    assert message.startswith(f"{PROXY_HEADER_ENV}: {header} cannot name the operator")
    assert "X-Forwarded-User" in message  # what to use instead


@pytest.mark.parametrize(
    "header", ["X-Forwarded-User", "X-Auth-Request-Email", "Remote-User", "X-Forwarded-Email"]
)
def test_a_header_only_the_proxy_sets_is_accepted(header: str) -> None:
    auth = auth_from_environment({PROXY_HEADER_ENV: header, TRUSTED_PROXIES_ENV: "10.0.0.7"})

    assert auth.proxy is not None
    assert auth.proxy.header == header


@pytest.mark.parametrize(
    ("proxies", "local"),
    [
        ("127.0.0.1", ["127.0.0.1/32"]),
        ("::1", ["::1/128"]),
        ("10.0.0.0/24, 127.0.0.0/8", ["127.0.0.0/8"]),
        ("::ffff:127.0.0.1", ["::ffff:127.0.0.1"]),  # 127.0.0.1, IPv4-mapped
        ("96.0.0.0/3", ["96.0.0.0/3"]),  # holds 127.0.0.1 too
        ("10.0.0.7, 192.0.2.0/24, fd00::/8", []),
    ],
)
def test_local_proxy_addresses_are_told_apart(proxies: str, local: list[str]) -> None:
    auth = auth_from_environment(
        {PROXY_HEADER_ENV: "X-Forwarded-User", TRUSTED_PROXIES_ENV: proxies}
    )

    assert auth.proxy is not None
    assert auth.proxy.local_networks() == tuple(map(ipaddress.ip_network, local))


def test_served_hosts_are_loopback_the_bound_address_and_those_named() -> None:
    assert served_hosts("127.0.0.1", LOOPBACK_HOSTS, {}) == LOOPBACK_HOSTS
    assert served_hosts("10.0.0.5", LOOPBACK_HOSTS, {}) == (*LOOPBACK_HOSTS, "10.0.0.5")
    # A wildcard bind is no name a browser uses: the names must be listed.
    assert served_hosts("0.0.0.0", LOOPBACK_HOSTS, {}) == LOOPBACK_HOSTS
    assert served_hosts("::", LOOPBACK_HOSTS, {HOSTS_ENV: "Console.Example.com, [fd00::1]"}) == (
        *LOOPBACK_HOSTS,
        "console.example.com",
        "fd00::1",
    )
    for bad in ("https://console.example.com", "console.example.com:443", "a b"):
        with pytest.raises(ConfigurationError, match=HOSTS_ENV):
            served_hosts("127.0.0.1", LOOPBACK_HOSTS, {HOSTS_ENV: bad})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("example.com", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_an_address_past_its_refused_logins_is_throttled_and_others_are_not() -> None:
    throttle = LoginThrottle(limit=3)
    for _ in range(3):
        assert not throttle.blocked("10.0.0.9")
        throttle.failed("10.0.0.9")

    assert throttle.blocked("10.0.0.9")
    assert not throttle.blocked("10.0.0.10")


def test_a_throttle_lifts_when_its_window_has_passed() -> None:
    throttle = LoginThrottle(limit=1, window=-1)
    throttle.failed("10.0.0.9")

    assert not throttle.blocked("10.0.0.9")


def test_the_printed_address_accepts_connections_before_uvicorn_runs() -> None:
    """`outbox console` prints its address before serving: a client that connects at
    once must wait in the listen backlog, not be refused."""
    from outbox.console.server import ConsoleServer

    async def app(scope: Any, receive: Any, send: Any) -> None:  # never called here
        raise AssertionError("not served in this test")

    server = ConsoleServer(app, host="127.0.0.1", port=0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5):
            pass
    finally:
        server.stop()
