"""Every failure in Anthropic's own shape: `{"type": "error", "error": {"type", "message"}}`.

Anthropic's SDKs pick their exception class from the HTTP status and read the message
from this body, so a litestar default body (`{"status_code", "detail"}`) would reach a
user as an unhelpful "unknown error". The server core renders errors on the paths this
frontend claims (`error_paths`) with `error_body`; the handler here, on the frontend's
Router, does the same for these routes when they are mounted in an app of their own
(tests, embedding), with the core's own classification of litestar's refusals.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response

from ninfer_core.serve.app import as_api_error
from ninfer_core.serve.errors import ApiError

#: ApiError kinds (ninfer_core.serve.errors) -> Anthropic error types.
TYPE_OF_KIND = {
    "invalid_request": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "overloaded": "rate_limit_error",
    "queue_timeout": "overloaded_error",
    "unavailable": "overloaded_error",
    "internal": "api_error",
}

#: For errors that carry only a status (litestar's own).
TYPE_OF_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int, kind: str | None = None) -> str:
    if kind in TYPE_OF_KIND:
        return TYPE_OF_KIND[kind]
    if status in TYPE_OF_STATUS:
        return TYPE_OF_STATUS[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """The JSON body (also the payload of a streamed `error` event)."""
    return {"type": "error", "error": {"type": error_type(status, kind), "message": message}}


def error_response(exc: ApiError) -> Response[Any]:
    """An `ApiError` as Anthropic answers it; usable by the server core (auth, limits)."""
    return Response(
        error_body(exc.status, exc.message, exc.kind),
        status_code=exc.status,
        headers=exc.headers or None,
    )


def _on_error(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Whatever a request raised — an `ApiError`, litestar's refusal of a body, a bug — as
    the server core classifies it for every frontend, in Anthropic's shape."""
    return error_response(as_api_error(exc, ready=True))


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {Exception: _on_error}
