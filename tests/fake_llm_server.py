"""A fake OpenAI- and Anthropic-compatible streaming server whose timings are scripted.

For `ninfer bench serve`'s tests: prefill takes `prompt_tokens / prefill_tok_s` seconds (one
request at a time with `serial_prefill`, as a server that prefills one request after the
other), then the first token, then one token every `1 / decode_tok_s` seconds, each sent at
its deadline from the first (no drift however the thread is scheduled). Prompt tokens are
the body's characters ÷ `chars_per_token`; usage carries them, and scripted speculation
figures ride in `usage.spec_stats` as NInfer sends them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "fake-model"


@dataclass
class Script:
    prefill_tok_s: float = 10_000.0
    decode_tok_s: float = 100.0
    chars_per_token: float = 3.0
    serial_prefill: bool = True
    count_tokens: bool = True
    #: A one-token request (a length probe) gets no text: its token was an end token.
    silent_probe: bool = False
    spec: dict[str, int] = field(
        default_factory=lambda: {"rounds": 5, "draft_tokens": 15, "accepted_tokens": 9}
    )
    #: Every request body received, for the tests to inspect.
    bodies: list[dict[str, Any]] = field(default_factory=list)


def prompt_tokens(body: dict[str, Any], script: Script) -> int:
    """The same count for a request and for count_tokens: the prompt fields' JSON length."""
    fields = [body.get(k) for k in ("system", "messages", "tools")]
    return max(1, round(len(json.dumps(fields, ensure_ascii=False)) / script.chars_per_token))


class Handler(BaseHTTPRequestHandler):
    script: Script
    prefill_lock: threading.Lock
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        script = self.script
        if self.path == "/v1/messages/count_tokens":
            if not script.count_tokens:
                self._json(404, {"error": "not found"})
            else:
                self._json(200, {"input_tokens": prompt_tokens(body, script)})
            return
        if self.path not in ("/v1/chat/completions", "/v1/messages"):
            self._json(404, {"error": "not found"})
            return
        script.bodies.append(body)
        anthropic = self.path == "/v1/messages"
        if not anthropic:  # the system message is a message here
            body = {**body, "system": body["messages"][0]["content"],
                    "messages": body["messages"][1:]}  # fmt: skip
        n_prompt, n_new = prompt_tokens(body, script), int(body["max_tokens"])
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True
        if anthropic:
            usage = {"input_tokens": n_prompt, "output_tokens": 0}
            self._event({"type": "message_start", "message": {"usage": usage}})
        if script.serial_prefill:
            with self.prefill_lock:
                time.sleep(n_prompt / script.prefill_tok_s)
        else:
            time.sleep(n_prompt / script.prefill_tok_s)
        first = time.perf_counter()
        for i in range(0 if n_new == 1 and script.silent_probe else n_new):
            deadline = first + i / script.decode_tok_s
            time.sleep(max(0.0, deadline - time.perf_counter()))
            if anthropic:
                delta = {"type": "text_delta", "text": f"t{i} "}
                self._event({"type": "content_block_delta", "index": 0, "delta": delta})
            else:
                self._event({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
        spec = dict(script.spec)
        if anthropic:
            usage = {"output_tokens": n_new, "spec_stats": spec}
            self._event({"type": "message_delta", "delta": {}, "usage": usage})
            self._event({"type": "message_stop"})
        else:
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n_new, "spec_stats": spec}
            self._event({"choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, data: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()


@contextmanager
def fake_server(script: Script) -> Iterator[str]:
    """The server on a free port, on a thread; yields its URL."""
    handler = type("ScriptedHandler", (Handler,),
                   {"script": script, "prefill_lock": threading.Lock()})  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
