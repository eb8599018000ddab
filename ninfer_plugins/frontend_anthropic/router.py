"""The frontend's litestar Router: its routes, its dependency and its error handlers.

Built per app (tests make several), with the served state bound through a dependency
rather than a module global. The exception handlers sit on the Router so that every
failure on these routes, litestar's own included, answers in Anthropic's shape while
another frontend on the same app keeps its own.
"""

from __future__ import annotations

from litestar import Router
from litestar.di import Provide

from ninfer_core.serve.state import ServeState
from ninfer_plugins.frontend_anthropic.context import Context
from ninfer_plugins.frontend_anthropic.count_tokens import count_tokens
from ninfer_plugins.frontend_anthropic.errors import EXCEPTION_HANDLERS
from ninfer_plugins.frontend_anthropic.messages import create_message


def build_router(state: ServeState, *, ping_interval_s: float = 5.0) -> Router:
    context = Context(state, ping_interval_s)

    def provide() -> Context:
        return context

    return Router(
        path="/v1",
        route_handlers=[create_message, count_tokens],
        dependencies={"anthropic": Provide(provide, sync_to_thread=False)},
        exception_handlers=EXCEPTION_HANDLERS,
        tags=["anthropic"],
    )
