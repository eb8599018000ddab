"""`ApiError`: a failure a frontend must answer in its protocol's own error shape.

Everything that goes wrong with a request becomes an `ApiError` (status, a type and a
message); each frontend renders it its own way (OpenAI `{"error": {...}}`, Anthropic
`{"type": "error", "error": {...}}`). Engine refusals map by their machine `code`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer_core.engine.request import EngineError


@dataclass
class ApiError(Exception):
    status: int
    #: A protocol-neutral kind: invalid_request, authentication, not_found, overloaded,
    #: queue_timeout, context_length_exceeded, request_too_large, internal.
    kind: str
    message: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param)


def from_engine_error(exc: EngineError) -> ApiError:
    """The HTTP answer to an engine refusal, with Retry-After where waiting helps."""
    code = getattr(exc, "code", "internal_error")
    retry = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(max(1, round(retry)))} if retry else {}
    if code == "overloaded":
        return ApiError(429, "overloaded", str(exc), headers=headers or {"Retry-After": "1"})
    if code == "queue_timeout":
        return ApiError(503, "queue_timeout", str(exc), headers=headers or {"Retry-After": "5"})
    if code == "engine_closed":
        return ApiError(503, "unavailable", str(exc), headers={"Retry-After": "5"})
    if code == "invalid_request":
        return ApiError(400, "invalid_request", str(exc))
    if code == "request_too_large":
        return ApiError(400, "context_length_exceeded", str(exc), param="max_tokens")
    return ApiError(500, "internal", str(exc))
