"""The fault-injection TCP proxy, against an echo server of its own (no services)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from harness.proxy import TcpProxy, ThreadedProxy

from support.waiting import eventually_sync


class EchoServer:
    """Echoes every byte back; counts what it received, so a test can see what passed."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = bytearray()
        # Per connection as well: two connections' bytes reach their echo threads in
        # no fixed order, so only each connection's own stream has one.
        self._streams: list[bytearray] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(connection,), daemon=True).start()

    def _echo(self, connection: socket.socket) -> None:
        stream = bytearray()
        with self._lock:
            self._streams.append(stream)
        with connection:
            while chunk := _recv(connection):
                with self._lock:
                    self.received.extend(chunk)
                    stream.extend(chunk)
                connection.sendall(chunk)

    def bytes_received(self) -> bytes:
        with self._lock:
            return bytes(self.received)

    def streams_received(self) -> list[bytes]:
        """What each connection sent, sorted (connections are accepted in no fixed order)."""
        with self._lock:
            return sorted(bytes(stream) for stream in self._streams)


def _recv(connection: socket.socket) -> bytes:
    try:
        return connection.recv(65536)
    except OSError:
        return b""


def read_exactly(client: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = client.recv(size - len(data))
        if not chunk:
            break
        data.extend(chunk)
    return bytes(data)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.listener.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[ThreadedProxy]:
    with ThreadedProxy("127.0.0.1", echo.port) as running:
        yield running


def connect(proxy: ThreadedProxy) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    eventually_sync(lambda: proxy.open_connections >= 1, within=10, what="proxy connected")
    return client


def test_bytes_pass_through_intact_and_in_order(proxy: ThreadedProxy) -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB: several chunks each way
    with connect(proxy) as client:
        client.sendall(payload)
        assert read_exactly(client, len(payload)) == payload


def test_a_delayed_link_still_delivers_everything_in_order(proxy: ThreadedProxy) -> None:
    proxy.delay(0.01)
    with connect(proxy) as client:
        for n in range(5):
            client.sendall(b"%d;" % n)
        assert read_exactly(client, 10) == b"0;1;2;3;4;"


def test_a_jittered_delay_draws_each_chunks_wait_between_its_bounds() -> None:
    proxy = TcpProxy("127.0.0.1", 1)
    proxy.delay(0.05, up_to=0.5)

    waits = {proxy.chunk_delay() for _ in range(200)}

    assert all(0.05 <= wait <= 0.5 for wait in waits)
    assert len(waits) > 1  # drawn, not one fixed figure
    proxy.restore()
    assert proxy.chunk_delay() == 0.0


def test_a_jittered_delayed_link_still_delivers_everything_in_order(
    proxy: ThreadedProxy,
) -> None:
    proxy.delay(0.001, up_to=0.02)
    with connect(proxy) as client:
        for n in range(5):
            client.sendall(b"%d;" % n)
        assert read_exactly(client, 10) == b"0;1;2;3;4;"


def test_a_black_hole_holds_traffic_until_restored(proxy: ThreadedProxy, echo: EchoServer) -> None:
    with connect(proxy) as client:
        client.sendall(b"before")
        assert read_exactly(client, 6) == b"before"
        proxy.blackhole()
        client.sendall(b"during")
        # The connection stays open while silent; what was sent arrives after restore.
        assert proxy.open_connections == 1
        assert echo.bytes_received() == b"before"
        proxy.restore()
        assert read_exactly(client, 6) == b"during"
    assert echo.bytes_received() == b"beforeduring"


def test_cut_aborts_every_open_connection_and_reports_how_many(proxy: ThreadedProxy) -> None:
    first, second = connect(proxy), connect(proxy)
    eventually_sync(lambda: proxy.open_connections == 2, within=10, what="two connections")
    with first, second:
        assert proxy.cut() == 2
        for client in (first, second):
            assert _recv(client) == b""  # reset or end of stream: the link is gone
    assert proxy.open_connections == 0
    with connect(proxy) as again:  # the proxy itself still accepts
        again.sendall(b"x")
        assert read_exactly(again, 1) == b"x"


def test_a_closed_proxy_refuses_connections_and_closes_again_quietly(echo: EchoServer) -> None:
    running = ThreadedProxy("127.0.0.1", echo.port).start()
    port = running.port
    running.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10)
    running.close()


@pytest.mark.parametrize("forward", [True, False])
def test_go_silent_on_silences_the_one_connection_that_sends_the_pattern(
    proxy: ThreadedProxy, echo: EchoServer, forward: bool
) -> None:
    proxy.go_silent_on(b"COMMIT", forward=forward)
    with connect(proxy) as silenced, connect(proxy) as other:
        silenced.sendall(b"UPDATE;")
        assert read_exactly(silenced, 7) == b"UPDATE;"
        silenced.sendall(b"COMMIT;")
        eventually_sync(lambda: proxy.went_silent, within=10, what="the pattern to be seen")
        silenced.sendall(b"after;")
        # The other connection still flows, both ways, and nothing more of the silenced
        # one reaches the server: the trigger itself only when it was to be forwarded.
        other.sendall(b"other;")
        assert read_exactly(other, 6) == b"other;"
        silenced_stream = b"UPDATE;COMMIT;" if forward else b"UPDATE;"
        expected = sorted([silenced_stream, b"other;"])
        eventually_sync(
            lambda: echo.streams_received() == expected, within=10, what="the bytes that pass"
        )
        silenced.settimeout(0.2)
        with pytest.raises(TimeoutError):
            silenced.recv(1)  # no answer comes back: a half-open link
        # One-shot: a later connection sending the pattern passes.
        with connect(proxy) as later:
            later.sendall(b"COMMIT;")
            assert read_exactly(later, 7) == b"COMMIT;"
