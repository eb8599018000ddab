"""`ninfer-serve` in a child process, and a small blocking HTTP client for it.

The isolation and soak benches measure the server as a user runs it: its own process (so its
RSS is its own, read from /proc), its own event loop and engine thread, reached over TCP.
The client is the standard library's `http.client`, so hostile bodies (huge prompts, broken
values) go out byte for byte, with no SDK validating them first.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.errors import NInferError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    """`VmRSS` (now) or `VmHWM` (peak) of process `pid`, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise NInferError(f"/proc/{pid}/status has no {field_name}")


class ServerProcess:
    """`ninfer-serve MODEL --port P ARGS…` started and waited for until /health answers 200."""

    def __init__(self, model: str | None, args: list[str], *, threads: int, ready_s: float = 300):
        self.port = free_port()
        argv = [sys.executable, "-m", "ninfer_core.cli.serve"] + ([model] if model else [])
        argv += ["--port", str(self.port), "--threads", str(threads), *args]
        self.argv = argv
        self.ready_s = ready_s
        #: The server's first API key, if it checks keys: /health says more to a client
        #: that may use the API (the kernel each op runs on, which benches print).
        given = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.key = given.split(",")[0].strip() if given else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.kernel_ops: list[dict[str, Any]] | None = None

    def __enter__(self) -> ServerProcess:
        # a file, not a pipe: nobody reads the log while the bench runs, and a full pipe
        # would stall the server on its next log line
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=self.log, env=os.environ.copy()
        )
        deadline = time.monotonic() + self.ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")
                self.log.close()
                raise NInferError(f"ninfer-serve exited with {self.proc.returncode}: {err[-2000:]}")
            try:
                health = request(self.port, "GET", "/health", None, timeout=2, key=self.key)
                if health.status == 200:
                    #: Which kernel backend serves each op, as the server reports it.
                    self.kernel_ops = (health.body or {}).get("kernel_ops")
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise NInferError(f"ninfer-serve did not become ready in {self.ready_s:.0f} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


@dataclass
class Reply:
    """One HTTP answer: status, and the JSON body or the SSE data lines with their times."""

    status: int
    body: Any = None
    events: list[tuple[float, Any]] = field(default_factory=list)


def request(
    port: int,
    method: str,
    path: str,
    payload: Any,
    *,
    timeout: float = 600,
    raw: bytes | None = None,
    key: str | None = None,
) -> Reply:
    """One request (`key`: its Bearer token); a streaming answer (text/event-stream) is
    read event by event, each data line parsed as JSON and stamped with
    `time.perf_counter()` when it arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = (
            raw if raw is not None else (None if payload is None else json.dumps(payload).encode())
        )
        headers = {"content-type": "application/json"} if body is not None else {}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        if "text/event-stream" not in resp.getheader("content-type", ""):
            data = resp.read()
            try:
                return Reply(resp.status, json.loads(data) if data else None)
            except ValueError:
                return Reply(resp.status, data.decode(errors="replace"))
        reply = Reply(resp.status)
        for data in _sse_data(resp):
            reply.events.append((time.perf_counter(), data))
        return reply
    finally:
        conn.close()


def _sse_data(resp: http.client.HTTPResponse) -> Iterator[Any]:
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        text = line[5:].strip().decode()
        if text == "[DONE]":
            return
        yield json.loads(text)
