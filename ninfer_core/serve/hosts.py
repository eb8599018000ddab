"""The `Host` check: a server that listens on loopback answers requests addressed to it.

A web page open in a browser on the serving machine can reach a server that listens only on
127.0.0.1 by DNS rebinding: the page's own name (`evil.example`) is made to resolve to
127.0.0.1, and the browser sends its requests there with `Host: evil.example`, unhindered by
CORS since the origin is the page's own. Checking `Host` closes that: a server listening
on loopback addresses only answers `Host` names of loopback (`localhost`, `127.x.x.x`,
`[::1]`, any port); one listening elsewhere answers any, as a server behind a proxy must.
`--allowed-hosts` names the hosts instead (comma-separated; `*`: any). A refused request
gets a 400 in its protocol's error shape, before anything else runs.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware

from ninfer_core.errors import elided
from ninfer_core.serve.errors import ApiError

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Receive, Scope, Send

    from ninfer_core.serve.app import ErrorShapes

#: What a loopback-only server answers to: its names and addresses, any port.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(address: str) -> bool:
    """Whether `address` (a name or an IP literal, brackets allowed) is this machine only."""
    name = address.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(option: str | None, listen: list[str]) -> list[str] | None:
    """The `Host` names to answer (None: any), from `--allowed-hosts` and the addresses
    the server listens on."""
    if option is not None:
        names = [n.strip().lower() for n in option.split(",") if n.strip()]
        return None if "*" in names else names
    return list(LOOPBACK_HOSTS) if listen and all(map(is_loopback, listen)) else None


def host_name(value: bytes) -> str:
    """`Host`'s name, without its port: `[::1]:8000` -> `::1`, `localhost:8000` -> `localhost`."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class HostGuard(ASGIMiddleware):
    """Answers 400 when the request's `Host` is not one of `allowed` (or a loopback name,
    when loopback is allowed)."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, allowed: list[str], shapes: ErrorShapes) -> None:
        self.allowed = set(allowed)
        self.loopback = any(is_loopback(name) for name in allowed)
        self.shapes = shapes

    def accepts(self, name: str) -> bool:
        return name in self.allowed or (self.loopback and is_loopback(name))

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        given = next((v for k, v in scope["headers"] if k == b"host"), b"")
        name = host_name(given)
        if self.accepts(name):
            await next_app(scope, receive, send)
            return
        error = ApiError(
            400,
            "invalid_request",
            f"this server does not answer to Host {elided(name, 64)!r}: it listens on loopback; "
            "--allowed-hosts names others",
        )
        await self.shapes.send(scope, send, error)
