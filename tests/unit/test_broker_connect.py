"""Connecting to the broker: a handshake the peer cuts short is a connection error."""

from __future__ import annotations

import asyncio

import aiormq.connection
import aiormq.exceptions
import pytest

from outbox.broker import connect


async def test_a_handshake_cut_before_the_first_frame_is_a_connection_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # aiormq raises StopAsyncIteration when the socket is already at end of file as it
    # reads the first frame: a race with a peer that closes at once, which loses to the
    # client's header write now and then under load. Forced here: wait for the end of
    # file, then do what aiormq does when it has already arrived.
    async def at_end_of_file(self: aiormq.connection.FrameReceiver) -> object:
        await self.reader.read()
        raise StopAsyncIteration

    monkeypatch.setattr(aiormq.connection.FrameReceiver, "get_frame", at_end_of_file)

    async def read_header_and_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.readexactly(len(b"AMQP\x00\x00\x09\x01"))  # the protocol header
        writer.close()

    server = await asyncio.start_server(read_header_and_close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        with pytest.raises(aiormq.exceptions.AMQPConnectionError, match="handshake"):
            await connect(f"amqp://guest:guest@127.0.0.1:{port}/", connection_name="test")
