"""The server's edges: framing, half-closed requests, deep JSON, slow and idle connections, the
connection cap, binding, and the API key from the environment.

Raw sockets against a real uvicorn server (`ServerThread`, with the same protocol and limits
`ninfer-serve` runs), with the limits set small so that each case takes a second or two.
"""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest
from serve_fixtures import (
    MODEL_ID,
    health_status,
    make_state,
    serve_process,
    serving,
    write_serve_model,
)

from ninfer_core.cli.serve import main as serve_main
from ninfer_core.serve.config import API_KEY_ENV, ConnectionLimits
from ninfer_core.serve.server import bind_sockets

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = ConnectionLimits(header_timeout_s=1.0, keep_alive_s=1.0, max_connections=6,
                          graceful_shutdown_s=1.0)  # fmt: skip
BODY_TIMEOUT_S = 1.0
#: How long a test waits for the server to do something it must do within about a second.
PATIENCE_S = 10.0
COMPLETION = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_serve_model(tmp_path_factory.mktemp("serve-edges-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(make_state(model_dir), limits=LIMITS, body_timeout_s=BODY_TIMEOUT_S) as srv:
        srv.port = int(srv.url.rsplit(":", 1)[1])
        yield srv


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(PATIENCE_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a timeout fails the test)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def post(path: bytes, body: bytes, *headers: bytes) -> bytes:
    head = [b"POST " + path + b" HTTP/1.1", b"Host: test", b"Content-Type: application/json",
            *headers]  # fmt: skip
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def status_and_json(raw: bytes) -> tuple[int, dict]:
    """The final response's status and JSON body (interim 1xx responses skipped)."""
    while True:
        head, _, raw = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status >= 200:
            return status, json.loads(raw)


# -- framing -------------------------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(server):
    """RFC 9112 §6.1: a request smuggling shape; h11 alone answers it 200 and keeps the
    connection open for the smuggled next request."""
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
    request = post(b"/v1/completions", chunked, b"Content-Length: %d" % len(COMPLETION),
                   b"Transfer-Encoding: chunked")  # fmt: skip
    with connect(server) as sock:
        sock.sendall(request)
        raw = read_all(sock)  # the server closes: read_all returns
    status, body = status_and_json(raw)
    assert status == 400 and "Content-Length and Transfer-Encoding" in body["error"]["message"]


@pytest.mark.parametrize("size", [b"f" * 40, b"zz", b"-1"])
def test_a_chunk_size_that_overflows_or_does_not_parse_is_a_400(server, size):
    """A chunk size of 40 hex digits (past any integer) or none at all: a 400 in JSON and
    the connection closed, not a connection dropped without an answer."""
    request = post(b"/v1/completions", size + b"\r\n{}\r\n0\r\n\r\n", b"Transfer-Encoding: chunked")
    with connect(server) as sock:
        sock.sendall(request)
        raw = read_all(sock)
    status, body = status_and_json(raw)
    assert status == 400 and body["error"]["message"]


def test_a_half_closed_request_is_answered(server):
    request = post(b"/v1/completions", COMPLETION, b"Content-Length: %d" % len(COMPLETION))
    with connect(server) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)  # the client is done sending, and waits
        raw = read_all(sock)
    status, body = status_and_json(raw)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_client_that_closed_fully_still_has_its_request_cancelled(server):
    """A full close looks like a half-close at first (an EOF); the server still tells them
    apart, so a client that left does not keep its generation running to the end."""
    engine = server.state.engine
    body = json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 1500, "ignore_eos": True})
    start = engine.counters.decode_tokens
    with connect(server) as sock:
        sock.sendall(post(b"/v1/completions", body.encode(), b"Content-Length: %d" % len(body)))
        deadline = time.monotonic() + PATIENCE_S
        while not engine.scheduler.running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + PATIENCE_S
    while engine.scheduler.running:
        assert time.monotonic() < deadline, "the request of a client that left kept running"
        time.sleep(0.02)
    assert engine.counters.decode_tokens - start < 1000


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b'{"model": "m", "prompt": ' + DEEP + b"}"),
        ("/v1/chat/completions", b'{"messages": [], "x": ' + DEEP + b"}"),
        ("/v1/messages", b'{"max_tokens": 1, "x": ' + DEEP + b"}"),
    ],
)
def test_deeply_nested_json_is_a_400_in_the_protocols_shape(server, path, body):
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "nested too deeply" in error["message"]
    assert (r.json().get("type") == "error") == (path == "/v1/messages")  # Anthropic envelope


# -- slow and idle connections -------------------------------------------------------------


def test_a_connection_that_never_finishes_its_headers_is_closed(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        for _ in range(10):  # a byte now and then does not keep it open (slowloris)
            time.sleep(0.2)
            try:
                sock.sendall(b"a")
            except OSError:  # closed by the server
                break
        assert read_all(sock) == b""  # closed without an answer


def test_a_connection_that_never_sends_a_byte_is_closed(server):
    with connect(server) as sock:
        assert read_all(sock) == b""


def test_an_idle_keep_alive_connection_is_closed(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        raw = read_all(sock)  # the answer, then the close after --keep-alive-s
    assert raw.startswith(b"HTTP/1.1 200 ")


def test_a_body_that_trickles_in_gets_a_408_in_the_protocols_shape(server):
    request = post(b"/v1/messages", b"", b"Content-Length: 100")
    with connect(server) as sock:
        sock.sendall(request)
        for _ in range(20):  # a byte every 0.2 s: never done within --body-timeout-s
            time.sleep(0.2)
            try:
                sock.sendall(b" ")
            except OSError:  # closed by the server
                break
        raw = read_all(sock)
    status, body = status_and_json(raw)
    assert status == 408 and body["type"] == "error"
    assert "--body-timeout-s" in body["error"]["message"]


def test_connections_over_the_cap_get_a_503_and_are_closed(server):
    held = [connect(server) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.2)  # all accepted
        with connect(server) as extra:
            raw = read_all(extra)
        assert raw.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in raw
    finally:
        for sock in held:
            sock.close()


# -- binding and the command ---------------------------------------------------------------


def test_bind_sockets_refuses_a_port_in_use_and_an_unknown_host_in_one_line():
    from ninfer_core.errors import NInferError

    (taken,) = bind_sockets("127.0.0.1", 0)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(NInferError, match=rf"^cannot listen on 127.0.0.1:{port}: "):
            bind_sockets("127.0.0.1", port)
    finally:
        taken.close()
    with pytest.raises(NInferError, match=r"^cannot listen on 'no-such-host.invalid': "):
        bind_sockets("no-such-host.invalid", 0)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("where", ["in use", "unknown host"])
def test_serve_exits_1_with_one_line_when_it_cannot_listen(model_dir, where):
    (taken,) = bind_sockets("127.0.0.1", 0)
    port = str(taken.getsockname()[1])
    host = "127.0.0.1" if where == "in use" else "no-such-host.invalid"
    try:
        proc = serve_process(model_dir, "--host", host, "--port", port)
        _, err = proc.communicate(timeout=120)
    finally:
        taken.close()
    assert proc.returncode == 1, err  # not 134 (SIGABRT from torch's threads at teardown)
    assert err.startswith("ninfer-serve: error: cannot listen on ") and err.count("\n") == 1, err
    assert "terminate called" not in err and "Traceback" not in err


def test_serve_listens_on_a_host_list_and_prints_the_real_addresses(model_dir):
    hosts = "0.0.0.0,::1" if ipv6_loopback() else "0.0.0.0"
    (probe,) = bind_sockets("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    proc = serve_process(model_dir, "--host", hosts, "--port", str(port))
    try:
        deadline = time.monotonic() + 120
        while health_status(f"http://127.0.0.1:{port}") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        if "::1" in hosts:
            assert health_status(f"http://[::1]:{port}") == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    expected = f"http://0.0.0.0:{port}" + (f", http://[::1]:{port}" if "::1" in hosts else "")
    assert f"listening on {expected} (" in out, out
    assert "torch threads: 1 (GOMP_SPINCOUNT=10000: spin, then sleep)" in out, out


def test_an_empty_api_key_is_refused_from_the_environment_as_from_the_option(monkeypatch, capsys):
    monkeypatch.setenv(API_KEY_ENV, "")
    assert serve_main([]) == 2
    from_env = capsys.readouterr().err
    monkeypatch.delenv(API_KEY_ENV)
    assert serve_main(["--api-key", ""]) == 2
    from_option = capsys.readouterr().err
    for err in (from_env, from_option):
        assert err.startswith("ninfer-serve: error: ") and err.count("\n") == 1
    assert API_KEY_ENV in from_env and "empty" in from_env
