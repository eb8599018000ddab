"""The API-key check: `Authorization: Bearer KEY` or `x-api-key: KEY`, before the body is read.

OpenAI clients send the key as a Bearer token and Anthropic clients as `x-api-key`; both are
accepted on every route, so one key serves both. `--api-key` may list several keys
(comma-separated): each client its own, and each key a tenant that the queue serves in
turn and whose prefix-cache blocks never mix with another's. The comparison is constant-time
(`hmac.compare_digest`) so response timing says nothing about how much of a guess was right.
The 401 is rendered in the shape of the protocol that owns the path (see `ErrorShapes`).
Routes whose handler sets `opt={"no_auth": True}` (`/health`) and CORS preflights are exempt.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware

from ninfer_core.serve.cache_salt import AUTHENTICATED_KEY
from ninfer_core.serve.errors import ApiError

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Receive, Scope, Send

    from ninfer_core.serve.app import ErrorShapes

NO_AUTH = "no_auth"


def presented_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    """Every key a request carries: its `x-api-key` headers, then its Bearer tokens."""
    given, bearers = [], []
    for name, value in headers:
        if name == b"x-api-key":
            given.append(value.strip())
        elif name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                bearers.append(token.strip())
    return given + bearers


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries: `x-api-key`, else a Bearer token, else None. A request
    that carries two different keys carries none: which one counts would be a guess."""
    keys = presented_keys(headers)
    return keys[0] if keys and all(k == keys[0] for k in keys) else None


def key_matches(presented: bytes | None, expected: bytes) -> bool:
    # Constant time in the key's contents; only a length mismatch answers faster.
    return presented is not None and hmac.compare_digest(presented, expected)


def authorized(headers: list[tuple[bytes, bytes]], keys: list[bytes]) -> bytes | None:
    """The key that authenticates a request with these headers, None if none does. Every
    key is compared, so the time says nothing about which one came close."""
    presented = presented_key(headers)
    matched = [key_matches(presented, key) for key in keys]
    return presented if any(matched) else None


def unauthorized(headers: list[tuple[bytes, bytes]]) -> ApiError:
    """The 401 for a request no key authenticates, saying what was wrong with it."""
    keys = presented_keys(headers)
    if not keys:
        message = "no API key given: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
    elif len(set(keys)) > 1:
        message = "more than one API key given: send one"
    else:
        message = "the API key is not valid"
    return ApiError(401, "authentication", message, headers={"WWW-Authenticate": "Bearer"})


class ApiKeyMiddleware(ASGIMiddleware):
    """Answers 401 before anything else runs when the request lacks the right key."""

    scopes = (ScopeType.HTTP,)
    exclude_opt_key = NO_AUTH

    def __init__(self, keys: list[bytes], shapes: ErrorShapes) -> None:
        self.expected = keys  # `serve/config.py`'s `server_keys`
        self.shapes = shapes

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if scope["method"] == "OPTIONS":  # a CORS preflight never carries credentials
            await next_app(scope, receive, send)
            return
        key = authorized(scope["headers"], self.expected)
        if key is not None:
            # The key salts the request's prefix-cache blocks (serve/cache_salt.py).
            scope[AUTHENTICATED_KEY] = key  # type: ignore[literal-required]
            await next_app(scope, receive, send)
            return
        await self.shapes.send(scope, send, unauthorized(scope["headers"]))
