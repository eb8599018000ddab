"""`create_app`: the litestar app that serves one model through every installed frontend.

The app exists before the model does: `ninfer-serve` starts listening at once (so `/health`
can say 503 while the model loads) and `attach_state` mounts the frontends' routes when the
`ServeState` is ready. Errors from every layer — litestar's parsing, the auth and body-limit
checks, the handlers — become `ApiError`s and are rendered by `ErrorShapes` in the shape of
the protocol that owns the path (docs/serving.md has the contract).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from litestar import Litestar, Request, Response, get
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotFoundException,
    ValidationException,
)
from litestar.openapi import OpenAPIConfig
from litestar.types import Scope, Send

from ninfer_core import __version__
from ninfer_core.plugin_host import PluginHost
from ninfer_core.plugin_types import Frontend
from ninfer_core.serve.auth import NO_AUTH, ApiKeyMiddleware, authorized, unauthorized
from ninfer_core.serve.config import server_keys
from ninfer_core.serve.errors import ApiError
from ninfer_core.serve.hosts import HostGuard
from ninfer_core.serve.limits import BodyLimitMiddleware
from ninfer_core.serve.metrics import CONTENT_TYPE, ServeMetrics
from ninfer_core.serve.shutdown import ShutdownGuard
from ninfer_core.serve.state import ServeState

log = logging.getLogger(__name__)

ErrorBody = Callable[[ApiError], dict[str, Any]]
KIND_OF_STATUS = {
    400: "invalid_request",
    401: "authentication",
    404: "not_found",
    413: "request_too_large",
    429: "overloaded",
    503: "unavailable",
}


def core_error_body(error: ApiError) -> dict[str, Any]:
    """The shape of errors on paths no frontend owns (`/metrics`, `/schema`)."""
    body: dict[str, Any] = {"type": error.kind, "message": error.message}
    if error.param is not None:
        body["param"] = error.param
    return {"error": body}


class ErrorShapes:
    """Which protocol shapes the errors of which paths: the longest owning prefix wins."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[str, ErrorBody]] = {}

    @classmethod
    def from_frontends(cls, frontends: Iterable[Frontend]) -> ErrorShapes:
        shapes = cls()
        for frontend in frontends:
            if frontend.error_body is None:  # the contract's default: the core shape
                continue
            for prefix in frontend.error_paths:
                shapes.add(prefix, frontend.name, frontend.error_body)
        return shapes

    def add(self, prefix: str, owner: str, render: ErrorBody) -> None:
        prefix = "/" + prefix.strip("/")
        if prefix in self._owners:
            raise ValueError(
                f"frontends {self._owners[prefix][0]!r} and {owner!r} both claim the "
                f"error shape of paths under {prefix}"
            )
        self._owners[prefix] = (owner, render)

    def body_for(self, path: str) -> ErrorBody:
        best, render = -1, core_error_body
        for prefix, (_, candidate) in self._owners.items():
            owns = path == prefix or path.startswith(prefix.rstrip("/") + "/")
            if owns and len(prefix) > best:
                best, render = len(prefix), candidate
        return render

    def encode(self, path: str, error: ApiError) -> tuple[bytes, dict[str, str]]:
        try:
            body = self.body_for(path)(error)
        except Exception:  # a broken renderer must not turn a 4xx into a crash
            log.exception("error renderer for %s failed", path)
            body = core_error_body(error)
        headers = {**error.headers, "content-type": "application/json"}
        return json.dumps(body, ensure_ascii=False).encode(), headers

    def response(self, path: str, error: ApiError) -> Response:
        content, headers = self.encode(path, error)
        return Response(content, status_code=error.status, headers=headers)

    async def send(self, scope: Scope, send: Send, error: ApiError) -> None:
        """Answer from an ASGI middleware, before any handler ran."""
        content, headers = self.encode(scope["path"], error)
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        raw.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": error.status, "headers": raw})
        await send({"type": "http.response.body", "body": content, "more_body": False})


def as_api_error(exc: Exception, *, ready: bool) -> ApiError:
    """Any exception a request raised, as the `ApiError` to answer with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationException):
        problems = exc.extra if isinstance(exc.extra, list) else []
        first = problems[0] if problems and isinstance(problems[0], dict) else {}
        key, message = first.get("key"), first.get("message") or exc.detail
        if key in (None, "data"):
            if message.startswith("'"):  # litestar's KeyError text: no body at all
                message = "the request body is missing; send a JSON object"
            return ApiError(400, "invalid_request", f"invalid request body: {message}")
        return ApiError(400, "invalid_request", f"{message} at `{key}`", param=key)
    if isinstance(exc, RecursionError):
        # msgspec decodes JSON recursively: a body nested deeper than the interpreter's
        # recursion limit (100k `[`) fails here, and the fault is the request's.
        return ApiError(400, "invalid_request", "the request body is nested too deeply")
    if isinstance(exc, NotFoundException) and not ready:
        return ApiError(
            503, "unavailable", "the model is still loading", headers={"Retry-After": "5"}
        )
    if isinstance(exc, MethodNotAllowedException):
        return ApiError(405, "invalid_request", exc.detail, headers=dict(exc.headers or {}))
    if isinstance(exc, HTTPException):
        status = exc.status_code
        kind = KIND_OF_STATUS.get(status, "internal" if status >= 500 else "invalid_request")
        detail = exc.detail if status < 500 else "internal server error"
        return ApiError(status, kind, detail, headers=dict(exc.headers or {}))
    log.error("unhandled %s", type(exc).__name__, exc_info=exc)
    return ApiError(500, "internal", f"internal server error ({type(exc).__name__})")


def cors_config(origins: list[str] | None) -> CORSConfig | None:
    """Browsers may call from `origins` with any header (the key rides in one) and read
    Retry-After, which a client backing off from a 429 or 503 needs."""
    if not origins:
        return None
    return CORSConfig(allow_origins=origins, allow_headers=["*"], expose_headers=["Retry-After"])


def create_app(
    state: ServeState | None,
    host: PluginHost,
    *,
    api_key: str | None = None,
    max_request_mib: float = 16.0,
    body_timeout_s: float | None = None,
    cors: list[str] | None = None,
    hosts: list[str] | None = None,
) -> Litestar:
    """The app; with `state` None it answers 503 until `attach_state` is called.
    `body_timeout_s`: a request's whole body must arrive within it (None: no limit).
    `hosts`: the `Host` names it answers (None: any; `serve/hosts.py`)."""
    frontends = list(host.frontends)
    shapes = ErrorShapes.from_frontends(frontends)
    metrics = ServeMetrics(lambda: app.state.serve)

    keys = server_keys(api_key) if api_key else None

    @get("/health", opt={NO_AUTH: True}, sync_to_thread=False, include_in_schema=False)
    def health(request: Request) -> Response:
        """Status for anyone (load balancers probe without a key); the model and the kernel
        each op runs on (which benches print) only for a client that may use the API."""
        serve = app.state.serve
        if not app.state.ready or serve is None:
            return Response({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        body: dict[str, Any] = {"status": "ok"}
        if keys is None or authorized(request.scope["headers"], keys) is not None:
            body["model"] = serve.options.model_id
            if serve.kernels:
                body["kernel_ops"] = [c.to_json() for c in serve.kernels]
        return Response(body)

    @get("/metrics", sync_to_thread=False, include_in_schema=False)
    def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def on_error(request: Request, exc: Exception) -> Response:
        headers = request.scope["headers"]
        if isinstance(exc, NotFoundException) and keys and authorized(headers, keys) is None:
            # An unknown path is as closed as a known one: without a key, a 401 (a 404
            # would tell a caller without a key which routes exist).
            return shapes.response(request.url.path, unauthorized(headers))
        return shapes.response(request.url.path, as_api_error(exc, ready=app.state.ready))

    limit = int(max_request_mib * 1024 * 1024)
    middleware: list[Any] = [BodyLimitMiddleware(limit, shapes, body_timeout_s)]
    if keys:
        middleware.insert(0, ApiKeyMiddleware(keys, shapes))
    if hosts is not None:  # before the key: a rebinding page holds no key anyway
        middleware.insert(0, HostGuard(hosts, shapes))
    middleware.insert(0, ShutdownGuard(shapes))  # outermost: it answers for what it wraps
    app = Litestar(
        route_handlers=[health, metrics_route],
        middleware=middleware,
        exception_handlers={Exception: on_error},
        before_send=[metrics.before_send],
        cors_config=cors_config(cors),
        openapi_config=OpenAPIConfig(title="NInfer", version=__version__, path="/schema"),
        request_max_body_size=None,  # BodyLimitMiddleware checks, in the protocol's shape
        state=State(
            {
                "serve": None,
                "ready": False,
                "metrics": metrics,
                "shapes": shapes,
                "frontends": frontends,
            }
        ),
        debug=False,
    )
    if state is not None:
        attach_state(app, state)
    return app


def attach_state(app: Litestar, state: ServeState) -> None:
    """Mount every frontend's routes for `state` and start answering. Call it on the event
    loop's thread (routes change under the router)."""
    if app.state.serve is not None:
        raise RuntimeError("this app already serves a model")
    app.state.metrics.instrument(state)
    for frontend in app.state.frontends:
        for handler in frontend.route_handlers(state):
            app.register(handler)
    app.state.serve = state
    app.state.ready = True
