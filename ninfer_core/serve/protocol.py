"""The HTTP/1.1 connection: uvicorn's h11 protocol with the guards a public server needs.

Only uvicorn's h11 protocol is installed with NInfer (httptools and zttp are optional extras
nobody may have), so `ninfer-serve` pins it and adds here what it lacks at the connection's
depth, where no ASGI app can see:

- **Header timeout.** uvicorn times out only an idle keep-alive connection, after a
  response; a connection that never completes its headers (slowloris), or never sends a
  byte, is held forever. Here a request's head must arrive within `header_timeout_s` of the
  connection opening, or of its first byte after a keep-alive wait; then the connection
  closes. (The body's deadline is `BodyLimitMiddleware`'s, which reads the body anyway and
  can answer in the protocol's shape.)
- **A connection cap.** uvicorn's `limit_concurrency` reads the request before refusing
  it; here connections over `max_connections` get a 503 at once and are closed unread.
- **Content-Length with Transfer-Encoding** (RFC 9112 §6.1: a smuggling attempt; the
  server MUST close the connection after answering). h11 frames such a request by its
  chunks and keeps the connection; here it is refused with a 400 and closed, before the app
  sees it.
- **A half-closed request** (the client sent it whole, then shut its side) is answered and
  then closed; uvicorn's protocol treats the EOF as a disconnect and answers nothing. A
  client that closed fully is still told apart, and its request cancelled (`_probe_peer`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ninfer.serve")

#: How often a half-closed connection waiting for its answer is checked for a client gone.
PROBE_S = 0.5


class _StrictConnection(h11.Connection):
    """h11's server side, refusing what RFC 9112 calls request smuggling."""

    refusal: str | None = None

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                self.refusal = "a request may not carry both Content-Length and Transfer-Encoding"
                raise h11.RemoteProtocolError(self.refusal)
        return event


def _plain_response(status: int, reason: str, kind: str, message: str, extra: str = "") -> bytes:
    """A complete response written straight to the socket (no h11 cycle to go through), in
    the core error shape: no route, so no protocol, has been chosen yet."""
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's `H11Protocol` with a header timeout, a connection cap, strict framing and
    answers to half-closed requests. Configure it through `guarded_protocol`."""

    header_timeout_s: float = 10.0
    max_connections: int | None = None
    last_refusal_warning: float = float("-inf")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _StrictConnection(h11.SERVER, limit)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False

    # -- the connection's life -------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.max_connections is not None and len(self.connections) >= self.max_connections:
            self._refused, self.transport = True, transport
            self._warn_refused()
            transport.write(
                _plain_response(
                    503, "Service Unavailable", "unavailable",
                    "too many open connections (--max-connections); retry later",
                    "retry-after: 1\r\n",
                )
            )  # fmt: skip
            transport.close()
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._between_requests():  # the first bytes of the next request's head
            self._arm_header_timer()
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived whole
            self._cancel_header_timer()

    def eof_received(self) -> bool | None:
        """The client shut its sending side. A request it sent whole still gets its answer
        (RFC 9112 §9.6: a half-close says "no more requests", not "no answer"); anything
        else (a partial request, an idle connection) can never complete, so it closes now."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or cycle.more_body:
            return None
        cycle.keep_alive = False  # answer, then close
        if not cycle.response_started and self.scope["http_version"] == "1.1":
            self._probe_peer()
        return True  # keep the transport open for the answer

    def _probe_peer(self) -> None:
        """Tell a half-closed client from one that left: an EOF looks the same either way,
        and a client that left must still cancel its request (its KV pages, its slot).
        A 102 interim response, which HTTP/1.1 clients must read past, makes a socket that
        is gone answer with a reset; then the connection closes and the request is cancelled
        as on any disconnect. Repeated until the answer starts."""
        cycle = self.cycle
        if cycle is None or cycle.response_started or self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.close()  # connection_lost marks the request disconnected
            return
        self.transport.write(self.conn.send(h11.InformationalResponse(status_code=102, headers=[])))
        self.loop.call_later(PROBE_S, self._probe_peer)

    def send_400_response(self, msg: str) -> None:
        refusal = getattr(self.conn, "refusal", None)
        self.transport.write(_plain_response(400, "Bad Request", "invalid_request", refusal or msg))
        self.transport.close()

    def _warn_refused(self) -> None:
        """At most one warning every 10 s: a flood of connections must not flood the log."""
        now, cls = time.monotonic(), type(self)
        if now - cls.last_refusal_warning >= 10:
            cls.last_refusal_warning = now  # per server: `guarded_protocol` made the class
            log.warning("refusing connections: %d open (--max-connections)", len(self.connections))

    # -- the header timer ------------------------------------------------------------------

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and self.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            log.info("closed a connection whose request head took over %ss", self.header_timeout_s)
            self.transport.close()


def guarded_protocol(
    header_timeout_s: float, max_connections: int | None
) -> type[GuardedH11Protocol]:
    """The protocol class for one server (uvicorn instantiates it per connection)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
    )
