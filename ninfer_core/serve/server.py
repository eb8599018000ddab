"""uvicorn, set up for `ninfer-serve`: sockets bound before anything loads, the connection
guards of `serve/protocol.py`, and a shutdown that ends every request in its protocol.

uvicorn's own shutdown waits `timeout_graceful_shutdown`, then cancels the request tasks:
a running stream is cut mid-body (no error event, no `[DONE]`/`message_stop`) and a request
that has not answered yet gets uvicorn's plain-text 500. `NInferServer` instead ends every
outstanding request in the engine when the graceful period is over (`end_requests`): each
handler then sees an engine error and answers as its frontend does — an error event in a
stream, a 503 in the protocol's shape otherwise — within `ENDING_S`, before uvicorn's
cancellation (the last resort, which `ShutdownGuard` still turns into a 503) would come.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

from ninfer_core.errors import NInferError
from ninfer_core.serve.config import ConnectionLimits
from ninfer_core.serve.protocol import guarded_protocol

#: After the graceful period, how long the ended requests have to write their error.
ENDING_S = 2.0


class NInferServer(uvicorn.Server):
    """uvicorn's Server, ending outstanding requests in their protocol before it cancels."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        graceful_s: float,
        end_requests: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self.graceful_s = graceful_s
        self.end_requests = end_requests

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        ending: list[asyncio.Task[None]] = []
        timer = None
        if self.end_requests is not None:
            end = self.end_requests
            timer = loop.call_later(self.graceful_s, lambda: ending.append(loop.create_task(end())))
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()
            await asyncio.gather(*ending, return_exceptions=True)


def build_server(
    app: Any,
    limits: ConnectionLimits,
    *,
    end_requests: Callable[[], Awaitable[None]] | None = None,
    log_level: str = "info",
) -> NInferServer:
    """The server for `app`; run it with `server.run(sockets=bind_sockets(...))`."""
    config = uvicorn.Config(
        app,
        http=guarded_protocol(limits.header_timeout_s, limits.max_connections),
        ws="none",
        lifespan="on",
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works
        # uvicorn's cancellation comes only after the requests were ended and had time to
        # answer (see NInferServer).
        timeout_graceful_shutdown=limits.graceful_shutdown_s + ENDING_S,  # type: ignore[arg-type]
        log_level=log_level,
    )
    return NInferServer(config, graceful_s=limits.graceful_shutdown_s, end_requests=end_requests)


def split_hosts(hosts: str) -> list[str]:
    """`--host` as a list: `127.0.0.1,::1` listens on both (as llama.cpp accepts it)."""
    names = [h.strip().strip("[]") for h in hosts.split(",")]
    if not all(names):
        raise NInferError(f"--host {hosts!r}: an empty address in the list")
    return names


def bind_sockets(hosts: str, port: int) -> list[socket.socket]:
    """A listening socket per address of every host (a name may resolve to several);
    one that cannot be bound (in use, unresolvable, not an address of this machine) is an
    `NInferError` naming it, with nothing left open. Port 0: one free port for all."""
    sockets: list[socket.socket] = []
    try:
        for host in split_hosts(hosts):
            for family, address in _addresses(host, port):
                sockets.append(_listen(family, (address[0], port, *address[2:]), host))
                port = port or sockets[-1].getsockname()[1]
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _addresses(host: str, port: int) -> list[tuple[int, tuple[Any, ...]]]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise NInferError(f"cannot listen on {host!r}: {exc.strerror}") from None
    return list(dict.fromkeys((family, addr) for family, _, _, _, addr in infos))


def _listen(family: int, address: tuple[Any, ...], host: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # `::` is IPv6 only; `0.0.0.0` may be listed beside it
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
        raise NInferError(f"cannot listen on {where}: {exc.strerror or exc}") from None
    return sock


def socket_urls(sockets: list[socket.socket]) -> list[str]:
    """The address each socket is bound to, as a URL (`0.0.0.0` stays `0.0.0.0`)."""
    urls = []
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        urls.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return urls
