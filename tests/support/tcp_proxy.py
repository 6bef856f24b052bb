"""An asyncio TCP proxy for fault injection: pass traffic, black-hole it, or cut it.

Point a daemon at ``proxy.port`` instead of the real service. ``blackhole()`` keeps
every socket open but forwards nothing (a silent peer, as after a network partition);
``cut()`` closes every open connection (a reset); ``restore()`` forwards again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.connections_accepted = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def blackhole(self) -> None:
        self._flowing.clear()

    def restore(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_accepted += 1
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
            chunk = await source.read(65536)
            if not chunk:
                sink.transport.abort()
                return
            # A black hole holds what arrives; the peer sees a silent connection.
            await self._flowing.wait()
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
