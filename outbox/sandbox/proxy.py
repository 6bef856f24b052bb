"""An asyncio TCP proxy for fault injection: pass traffic, slow it, black-hole it, cut it.

Point a daemon at ``proxy.port`` instead of the real service. ``delay(s)`` holds every
chunk that long before passing it on (a slow link); ``blackhole()`` keeps every socket
open but forwards nothing (a silent peer, as after a network partition: what arrives
meanwhile is held, as TCP would retransmit it); ``cut()`` aborts every open connection
(a reset); ``restore()`` forwards again at full speed.

:class:`TcpProxy` runs on the caller's event loop (tests); :class:`ThreadedProxy` runs
one on a loop of its own in a background thread, for synchronous callers such as
``outbox chaos``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK_BYTES = 65536


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._delay_seconds = 0.0
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.connections_accepted = 0

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

    def delay(self, seconds: float) -> None:
        self._delay_seconds = seconds

    def blackhole(self) -> None:
        self._flowing.clear()

    def restore(self) -> None:
        self._delay_seconds = 0.0
        self._flowing.set()

    def cut(self) -> int:
        """Abort every open connection; how many client connections that ended."""
        ended = self.open_connections
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
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
        await asyncio.gather(
            self._pipe(reader, upstream_writer),
            self._pipe(upstream_reader, writer),
            return_exceptions=True,
        )
        for side in (writer, upstream_writer):
            self._writers.discard(side)
            side.transport.abort()

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while True:
            chunk = await source.read(CHUNK_BYTES)
            if not chunk:
                sink.transport.abort()
                return
            await self._flowing.wait()
            if self._delay_seconds > 0.0:
                # Injected latency, per chunk and in order: a slow link, not a timer.
                await asyncio.sleep(self._delay_seconds)
                await self._flowing.wait()  # a black hole may have opened meanwhile
            sink.write(chunk)
            await sink.drain()


@contextlib.asynccontextmanager
async def tcp_proxy(target_host: str, target_port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


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

    def delay(self, seconds: float) -> None:
        self._call(lambda: self._proxy.delay(seconds))

    def blackhole(self) -> None:
        self._call(self._proxy.blackhole)

    def restore(self) -> None:
        self._call(self._proxy.restore)

    def cut(self) -> int:
        return self._call(self._proxy.cut)

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
