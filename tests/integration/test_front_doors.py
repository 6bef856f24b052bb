"""The three network front ends (``outbox callbacks serve``, ``outbox console``,
``outbox mcp`` over HTTP) behind the one serving layer, over real sockets: a head that
never completes is closed, a body that never completes is a 408, a body over the limit
is a 413 without being read, and connections past the cap are refused while the ones
held stay served (issue #46 item 5). Each front end's app is built as its command builds
it, with short deadlines so that a test waits seconds, not the defaults.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from outbox import Settings
from outbox.console.app import create_app as console_app
from outbox.console.server import ConsoleServer
from outbox.mcp.transports import http_app
from outbox.serving import Limits
from outbox.serving.server import AppServer

from support.callback_helpers import callback_registry, receiving
from support.console_helpers import console, console_settings
from support.mcp_cases import server as mcp_server
from support.sample_tools import Ledger

MAX_BODY = 4096
CAP = 3
# Far longer than any deadline below: a connection still open after it was never closed.
PATIENCE = 20.0

LIMITS = Limits(
    max_body=MAX_BODY, header_seconds=0.5, body_seconds=0.5, max_connections=CAP, grace_seconds=1
)

Serve = Callable[[Limits], contextlib.AbstractContextManager[tuple[str, int]]]


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


@pytest.fixture(params=["callbacks", "console", "mcp"])
def front_door(request: pytest.FixtureRequest, settings: Settings, database_url: str) -> Serve:
    """Serves the named front end's app through the serving layer with the limits given."""

    @contextlib.contextmanager
    def callbacks(limits: Limits) -> Iterator[tuple[str, int]]:
        registry = callback_registry(Ledger())
        with receiving(settings, database_url, registry, limits=limits) as running:
            yield _address(running.url)

    @contextlib.contextmanager
    def operator_console(limits: Limits) -> Iterator[tuple[str, int]]:
        app = console_app(console(console_settings(settings, database_url)))
        with ConsoleServer(app, "127.0.0.1", 0, limits=limits) as running:
            yield _address(running.url)

    @contextlib.contextmanager
    def mcp(limits: Limits) -> Iterator[tuple[str, int]]:
        registry = callback_registry(Ledger())
        app = http_app(mcp_server(registry, settings), host="127.0.0.1", credentials=())
        with AppServer(app, "127.0.0.1", 0, name="outbox-mcp-test", limits=limits) as running:
            yield _address(running.url)

    serves: dict[str, Serve] = {"callbacks": callbacks, "console": operator_console, "mcp": mcp}
    return serves[request.param]


def connect(address: tuple[str, int]) -> socket.socket:
    return socket.create_connection(address, timeout=PATIENCE)


def read_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still
    open after PATIENCE seconds."""
    received = b""
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            chunk = connection.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the server kept the connection open ({received[:80]!r} so far)")


def read_answer(connection: socket.socket) -> bytes:
    """One whole response (head and Content-Length body), so that the next one read on
    the connection starts at its own status line."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(65536)
        if not chunk:
            return received
        received += chunk
    response_head, _, body = received.partition(b"\r\n\r\n")
    lengths = [
        int(line.split(b":", 1)[1])
        for line in response_head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    ]
    while lengths and len(body) < lengths[0]:
        chunk = connection.recv(65536)
        if not chunk:
            break
        body += chunk
    return response_head + b"\r\n\r\n" + body


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:80]
    return int(answer.split(b" ", 2)[1])


def head(method: str, **headers: str) -> bytes:
    lines = [f"{method} /healthz HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_head_that_never_completes_is_closed(front_door: Serve) -> None:
    with front_door(LIMITS) as address, connect(address) as slow:
        slow.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")

        assert read_until_closed(slow) == b""


def test_a_body_that_never_completes_is_a_408_and_closed(front_door: Serve) -> None:
    with front_door(LIMITS) as address, connect(address) as slow:
        slow.sendall(head("POST", content_length="100") + b"x" * 10)

        answer = read_until_closed(slow)

    assert status_of(answer) == 408
    assert b'{"error": "body_timeout"}' in answer


def test_a_declared_length_over_the_limit_is_a_413_before_the_body_is_sent(
    front_door: Serve,
) -> None:
    with front_door(LIMITS) as address, connect(address) as client:
        client.sendall(head("POST", content_length=str(MAX_BODY + 1)))

        answer = read_answer(client)

    assert status_of(answer) == 413
    assert b'{"error": "too_large"}' in answer


def test_a_chunked_body_is_refused_413_where_it_crosses_the_limit(front_door: Serve) -> None:
    chunk = b"x" * 1024
    with front_door(LIMITS) as address, connect(address) as client:
        client.sendall(head("POST", transfer_encoding="chunked"))
        # One chunk past the limit and no last chunk: the answer cannot wait for the end.
        for _ in range(MAX_BODY // len(chunk) + 1):
            client.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))

        answer = read_answer(client)

    assert status_of(answer) == 413


def test_connections_past_the_cap_are_refused_and_those_held_stay_served(
    front_door: Serve,
) -> None:
    limits = Limits(
        max_body=MAX_BODY,
        header_seconds=PATIENCE,
        body_seconds=PATIENCE,
        max_connections=CAP,
        grace_seconds=1,
    )
    with front_door(limits) as address, contextlib.ExitStack() as held:
        served = [held.enter_context(connect(address)) for _ in range(CAP)]
        for connection in served:
            connection.sendall(head("GET"))
            assert status_of(read_answer(connection)) != 503
        # Past the cap, silent like a slowloris: refused without waiting for a head.
        extra = held.enter_context(connect(address))
        refused = read_until_closed(extra)
        for connection in served:
            connection.sendall(head("GET"))
            assert status_of(read_answer(connection)) != 503

    assert refused == b"" or status_of(refused) == 503
