"""An asyncio TCP proxy for fault injection: pass traffic, slow it, black-hole it, cut it.

Point a daemon at ``proxy.port`` instead of the real service. ``delay(s)`` holds every
chunk that long before passing it on (a slow link; ``delay(s, up_to=u)``: each chunk a
time of its own between the two, as a busy server answers); ``blackhole()`` keeps every socket
open but forwards nothing (a silent peer, as after a network partition: what arrives
meanwhile is held, as TCP would retransmit it, and so is a close: neither end learns that
the other went away); ``cut()`` aborts every open connection (a reset); ``restore()``
forwards again at full speed.

``go_silent_on(pattern)`` silences one connection for good, at a chosen moment: the
first connection whose client sends a chunk containing ``pattern`` forwards that chunk
(or not) and then nothing more in either direction, as a half-open link does. Other
connections are untouched. That puts a partition exactly between a statement and its
answer, or between an UPDATE and its COMMIT.

:class:`TcpProxy` runs on the caller's event loop (tests); :class:`ThreadedProxy` runs
one on a loop of its own in a background thread, for synchronous callers such as
:mod:`harness.chaos`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")

CHUNK_BYTES = 65536


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._delay_seconds = 0.0
        self._delay_up_to = 0.0
        self._writers: set[asyncio.StreamWriter] = set()
        self._links: set[asyncio.Event] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.connections_accepted = 0
        self._silence_pattern: bytes | None = None
        self._forward_trigger = True
        self.went_silent = asyncio.Event()
        """Set when a connection matched the ``go_silent_on`` pattern."""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.restore()  # release pipes waiting on a black hole so they can end
        self.cut()
        # Wait for every connection's handler, so none is left pending on a closed loop.
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    @property
    def open_connections(self) -> int:
        return len(self._writers) // 2

    def delay(self, seconds: float, *, up_to: float | None = None) -> None:
        self._delay_seconds = seconds
        self._delay_up_to = max(seconds, up_to if up_to is not None else seconds)

    def chunk_delay(self) -> float:
        """How long the next chunk waits: the delay, or a draw between it and ``up_to``."""
        if self._delay_up_to <= self._delay_seconds:
            return self._delay_seconds
        # Not for security: jitter of an injected fault.
        return random.uniform(self._delay_seconds, self._delay_up_to)  # noqa: S311

    def blackhole(self) -> None:
        self._flowing.clear()

    def restore(self) -> None:
        """Forward again; a connection silenced by ``go_silent_on`` stays silent."""
        self._delay_seconds = self._delay_up_to = 0.0
        self._flowing.set()

    def go_silent_on(self, pattern: bytes, *, forward: bool = True) -> None:
        """Silence the first connection whose client sends ``pattern`` (once); with
        ``forward`` the chunk that matched still reaches the server."""
        self._silence_pattern = pattern
        self._forward_trigger = forward
        self.went_silent.clear()

    def cut(self) -> int:
        """Abort every open connection; how many client connections that ended."""
        ended = self.open_connections
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        for link in self._links:
            link.set()  # lets a silenced connection's pipes see the reset and end
        return ended

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_accepted += 1
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, upstream_writer))
        link = asyncio.Event()  # this connection's own flow, cleared when it goes silent
        link.set()
        self._links.add(link)
        await asyncio.gather(
            self._pipe(reader, upstream_writer, link, from_client=True),
            self._pipe(upstream_reader, writer, link, from_client=False),
            return_exceptions=True,
        )
        self._links.discard(link)
        for side in (writer, upstream_writer):
            self._writers.discard(side)
            side.transport.abort()

    async def _pipe(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        link: asyncio.Event,
        *,
        from_client: bool,
    ) -> None:
        while True:
            chunk = await source.read(CHUNK_BYTES)
            if not chunk:
                # A close crosses a silent link no more than data does.
                await self._flows(link)
                sink.transport.abort()
                return
            if from_client and self._silences(chunk):
                if self._forward_trigger:
                    sink.write(chunk)
                link.clear()
                self.went_silent.set()
                continue
            await self._flows(link)
            if self._delay_seconds > 0.0:
                # Injected latency, per chunk and in order: a slow link, not a timer.
                await asyncio.sleep(self.chunk_delay())
                await self._flows(link)  # a black hole may have opened meanwhile
            sink.write(chunk)
            await sink.drain()

    def _silences(self, chunk: bytes) -> bool:
        if self._silence_pattern is None or self._silence_pattern not in chunk:
            return False
        self._silence_pattern = None
        return True

    async def _flows(self, link: asyncio.Event) -> None:
        await self._flowing.wait()
        await link.wait()


@contextlib.asynccontextmanager
async def tcp_proxy(target_host: str, target_port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


@contextlib.asynccontextmanager
async def tcp_proxy_for(url: str, default_port: int) -> AsyncIterator[TcpProxy]:
    """A proxy in front of the service a URL names."""
    parts = urlsplit(url)
    async with tcp_proxy(parts.hostname or "127.0.0.1", parts.port or default_port) as proxy:
        yield proxy


def url_through(url: str, port: int) -> str:
    """The URL with its host and port replaced by a local proxy's, credentials kept."""
    parts = urlsplit(url)
    credentials, _, _ = parts.netloc.rpartition("@")
    netloc = f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=f"{credentials}@{netloc}" if credentials else netloc))


class ThreadedProxy:
    """A :class:`TcpProxy` on its own event loop in a daemon thread; every method is safe
    to call from any other thread and returns once the proxy has acted."""

    CALL_TIMEOUT_SECONDS = 10.0

    def __init__(self, target_host: str, target_port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="outbox-tcp-proxy", daemon=True
        )
        self._proxy = TcpProxy(target_host, target_port)

    @property
    def port(self) -> int:
        return self._proxy.port

    def start(self) -> ThreadedProxy:
        self._thread.start()
        self._call_async(self._proxy.start())
        return self

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call_async(self._proxy.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.CALL_TIMEOUT_SECONDS)
        self._loop.close()

    def delay(self, seconds: float, *, up_to: float | None = None) -> None:
        self._call(lambda: self._proxy.delay(seconds, up_to=up_to))

    def blackhole(self) -> None:
        self._call(self._proxy.blackhole)

    def restore(self) -> None:
        self._call(self._proxy.restore)

    def cut(self) -> int:
        return self._call(self._proxy.cut)

    def go_silent_on(self, pattern: bytes, *, forward: bool = True) -> None:
        self._call(lambda: self._proxy.go_silent_on(pattern, forward=forward))

    @property
    def went_silent(self) -> bool:
        return self._call(self._proxy.went_silent.is_set)

    @property
    def open_connections(self) -> int:
        return self._call(lambda: self._proxy.open_connections)

    def _call(self, action: Callable[[], T]) -> T:
        async def on_loop() -> T:
            return action()

        return self._call_async(on_loop())

    def _call_async(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout=self.CALL_TIMEOUT_SECONDS)

    def __enter__(self) -> ThreadedProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
