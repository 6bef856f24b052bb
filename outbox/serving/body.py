"""The request side of the serving layer: a request's whole body is read, within its
deadline and up to its limit, before the app is called. The app never sees a partial
body, and a body too large or too slow costs at most the limit in memory.

- ``Content-Length`` over the limit: 413 at once, nothing of the body read.
- A body without a length (chunked) that grows past the limit: 413 where it crosses it.
- A body that has not all arrived ``body_seconds`` after its head: 408, connection
  closed.
- A client that goes away mid-body: nothing is answered and the app is not called.

A request without a body (no ``Content-Length``, no ``Transfer-Encoding``) goes to the
app untouched, so a long-lived response stream (MCP's GET) still hears of a disconnect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
# Told of each request refused here, with its scope and the error answered
# ("too_large", "body_timeout"): a front end that counts its refusals counts these too.
Refused = Callable[[Scope, str], None]


class BodyLimits:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body: int,
        body_seconds: float,
        refused: Refused | None = None,
    ) -> None:
        self.app = app
        self.max_body = max_body
        self.body_seconds = body_seconds
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lengths = [value for name, value in scope["headers"] if name == b"content-length"]
        chunked = any(name == b"transfer-encoding" for name, _ in scope["headers"])
        if not lengths and not chunked:
            await self.app(scope, receive, send)
            return
        if lengths:
            declared = lengths[0]
            # h11 has refused a malformed or repeated-and-different Content-Length.
            if int(declared) > self.max_body:
                await self._refuse(scope, send, 413, "too_large")
                return
        try:
            async with asyncio.timeout(self.body_seconds):
                body = await read_body(receive, self.max_body)
        except TimeoutError:
            await self._refuse(scope, send, 408, "body_timeout")
            return
        if body is None:
            return
        if len(body) > self.max_body:
            await self._refuse(scope, send, 413, "too_large")
            return
        await self.app(scope, replay(body, receive), send)

    async def _refuse(self, scope: Scope, send: Send, status: int, error: str) -> None:
        if self.refused is not None:
            self.refused(scope, error)
        # A late body is closed: the rest of it must not be read as the next request. A
        # large one is not: the client may still be sending, and a reset could lose it
        # the answer; the head deadline ends a connection that keeps on sending.
        await _answer(send, status, error, close=status == 408)


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or as soon as it is over ``limit`` the part read so far (so at most
    ``limit`` plus one message is held); None when the client went away."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > limit or not message.get("more_body", False):
            return bytes(body)


def replay(body: bytes, receive: Receive) -> Receive:
    """The body in one message, then whatever the connection says next (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _answer(send: Send, status: int, error: str, *, close: bool) -> None:
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
