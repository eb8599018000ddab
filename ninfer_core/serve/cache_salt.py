"""The prefix-cache salt of a request: who sent it (the API key) and what it asked for.

Requests share cached KV blocks only when their salts are equal (`GenerationRequest.
cache_salt`, mixed into the prefix cache's hash chain). Without a salt a client can learn
whether anyone else sent a prompt from `cached_tokens` (a timing side channel too). So:

- when the server checks API keys, the key that authenticated the request salts it: clients
  holding different keys never share blocks (`ApiKeyMiddleware` leaves the key in the ASGI
  scope under `AUTHENTICATED_KEY`);
- a request may add its own `cache_salt` (as vLLM takes it), e.g. one per end user, to
  narrow sharing further.

Only a hash of the two reaches the engine, so the key is never held or logged there. The
key alone, hashed, also names the request's tenant (`tenant`): the queue admits tenants in
turn and may bound what each has waiting (`engine/scheduler.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from ninfer_core.serve.errors import invalid

#: The ASGI scope key under which the auth middleware leaves the key it accepted (bytes).
AUTHENTICATED_KEY = "ninfer.api_key"
#: Longer client salts are refused: a salt names a tenant, it is not a payload.
MAX_SALT_CHARS = 1024


def cache_salt(scope: Mapping[str, Any], requested: str | None) -> str | None:
    """The salt for a request: None when no key was checked and none was asked for (the
    shared pool); a 400 naming `cache_salt` for an empty or oversized one."""
    if requested is not None and not 0 < len(requested) <= MAX_SALT_CHARS:
        raise invalid(
            f"cache_salt: must be 1 to {MAX_SALT_CHARS} characters, got {len(requested)}",
            param="cache_salt",
        )
    key: bytes | None = scope.get(AUTHENTICATED_KEY)
    if key is None and requested is None:
        return None
    digest = hashlib.sha256()
    for part in (key, None if requested is None else requested.encode()):
        # Length-prefixed, so no (key, salt) pair can collide with another's concatenation.
        digest.update(b"-" if part is None else len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()


def tenant(scope: Mapping[str, Any]) -> str | None:
    """Who sent the request, for fair admission: a hash of the API key that authenticated
    it (None when the server checks no key)."""
    key: bytes | None = scope.get(AUTHENTICATED_KEY)
    if key is None:
        return None
    return hashlib.sha256(b"tenant:" + key).hexdigest()[:16]
