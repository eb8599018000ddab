"""A request's limits: its body size, checked before parsing, and its client's lifetime.

The body limit runs before litestar reads the body: a `Content-Length` over the limit is
refused without reading a byte, and a chunked body is counted as it arrives and refused the
moment it passes the limit. A body within the limit is handed on whole, so the handler (and
litestar's JSON decoder) never starts on something it would have to abandon. The whole body
must arrive within `timeout_s` of the request's head (`--body-timeout-s`): a client trickling
it a byte at a time gets a 408 and the connection closes (the rest of the body is unread).

`until_disconnect` covers the time before a response starts: a non-streaming generation, or
the wait for a stream's first event. A client that leaves then would otherwise keep its
request running (or queued) to the end; with it, the work is cancelled and its KV pages
return. Once a streaming response has started, litestar itself cancels the stream on
disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware

from ninfer_core.serve.errors import ApiError

if TYPE_CHECKING:
    from litestar import Request
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from ninfer_core.serve.app import ErrorShapes

T = TypeVar("T")

#: The status nginx made the convention for "the client closed the request".
CLIENT_CLOSED = 499


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        "request_too_large",
        f"the request body is larger than this server's limit of {limit} bytes (--max-request-mib)",
    )


def _too_slow(timeout_s: float) -> ApiError:
    return ApiError(
        408,
        "invalid_request",
        f"the request body did not arrive within {timeout_s:g} s (--body-timeout-s)",
        headers={"Connection": "close"},
    )


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimitMiddleware(ASGIMiddleware):
    """Reads the whole body up to `limit` bytes, within `timeout_s`, before the handler
    runs; over the limit: 413; too slow: 408."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, limit: int, shapes: ErrorShapes, timeout_s: float | None = None) -> None:
        self.limit = limit
        self.shapes = shapes
        self.timeout_s = timeout_s or None

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        declared = _declared_length(scope)
        if declared is not None and declared > self.limit:
            await self.shapes.send(scope, send, _too_large(self.limit))
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            await self.shapes.send(scope, send, _too_slow(self.timeout_s or 0))
            return
        except _TooLarge:
            await self.shapes.send(scope, send, _too_large(self.limit))
            return
        if body is not None:  # None: the client left, nobody is left to answer
            await next_app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                raise _TooLarge
            chunks.append(body)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then the connection's own messages
    (so a later `http.disconnect` still reaches whoever listens for it)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first: then `work` is cancelled (its
    `finally` blocks cancel the engine request) and a 499 `ApiError` is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is going down: take the work with us
        task.cancel()
        # Wait for it: a caller's cleanup (closing the generator `work` is reading) must not
        # run while `work` is still inside it ("aclose(): asynchronous generator is already
        # running").
        await asyncio.gather(task, return_exceptions=True)
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ApiError(CLIENT_CLOSED, "cancelled", "the client closed the connection")
