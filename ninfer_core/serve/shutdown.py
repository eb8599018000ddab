"""The end of a shutdown's graceful period: every outstanding request gets an answer.

`end_requests` closes the engine with "the server is shutting down": every live request,
running or queued, ends with an `EngineClosedError`, which the frontends already turn into
their protocol's error (an error event in a started stream, a 503 otherwise), and a request
submitted after that is refused the same way. `ShutdownGuard` is the last resort for a
request that still had not answered when uvicorn cancelled it (one busy rendering a
template, say): it answers the 503 itself instead of uvicorn's plain-text 500.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware

from ninfer_core.serve.errors import ApiError

if TYPE_CHECKING:
    from litestar import Litestar
    from litestar.types import ASGIApp, Message, Receive, Scope, Send

    from ninfer_core.serve.app import ErrorShapes

log = logging.getLogger("ninfer.serve")

SHUTTING_DOWN = "the server is shutting down"


def shutting_down() -> ApiError:
    return ApiError(503, "unavailable", SHUTTING_DOWN, headers={"Retry-After": "5"})


async def end_requests(app: Litestar) -> None:
    """End every request of the app's engine (none while the model still loads)."""
    serve = app.state.serve
    if serve is not None:
        log.warning("graceful shutdown period over: ending the requests still outstanding")
        # close() waits for the step in progress: not on the event loop.
        await asyncio.to_thread(serve.engine.close, SHUTTING_DOWN)


class ShutdownGuard(ASGIMiddleware):
    """A request cancelled before its response started answers 503 in its protocol's shape.

    uvicorn cancels a request's task only when its graceful shutdown is over; the request
    then has its answer, so the cancellation has done its work and is not re-raised. After
    the response started, the cancellation goes on (the connection is cut).
    """

    scopes = (ScopeType.HTTP,)

    def __init__(self, shapes: ErrorShapes) -> None:
        self.shapes = shapes

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await next_app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started:
                raise
            await self.shapes.send(scope, send, shutting_down())
