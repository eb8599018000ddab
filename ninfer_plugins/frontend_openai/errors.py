"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.

The `type` and `code` strings are the ones OpenAI's own API answers with (and its SDK and
the tools built on it switch on): `invalid_request_error` with a `code` such as
`context_length_exceeded` or `model_not_found`, `rate_limit_error` for 429.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.serve.errors import ApiError

#: ApiError kind -> (type, code).
SHAPES: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "not_found": ("invalid_request_error", "not_found"),
    "context_length_exceeded": ("invalid_request_error", "context_length_exceeded"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "overloaded": ("rate_limit_error", "rate_limit_exceeded"),
    "queue_timeout": ("server_error", "request_queue_timeout"),
    "unavailable": ("server_error", "service_unavailable"),
    "cancelled": ("invalid_request_error", "client_closed_request"),
    "internal": ("server_error", "internal_error"),
}


def error_body(error: ApiError) -> dict[str, Any]:
    kind, code = SHAPES.get(
        error.kind, ("server_error" if error.status >= 500 else "invalid_request_error", None)
    )
    if error.kind == "not_found" and error.param == "model":
        code = "model_not_found"
    if error.status == 405:
        code = "method_not_allowed"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}
