"""The server itself: auth, error shapes, health, metrics, overload, disconnects, bad input, and
the `ninfer-serve` command with its shutdown.

Real servers on 127.0.0.1 (uvicorn on a thread), a tiny model behind a real engine, the
official `openai` SDK where a client would use it and raw `httpx` where the bytes matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import openai
import pytest
from litestar import post
from litestar.params import JSONBody
from serve_fixtures import (
    MODEL_ID,
    frontends_host,
    health_status,
    make_state,
    serve_process,
    serving,
    wait_for,
    write_serve_model,
)

from ninfer_core import hookimpl
from ninfer_core.cli.serve import ServerThread
from ninfer_core.cli.serve import main as serve_main
from ninfer_core.serve.app import ErrorShapes, attach_state, create_app
from ninfer_core.serve.errors import ApiError
from ninfer_core.support import Support

KEY = "s3cret"
LIMIT_MIB = 0.05  # ~52 KB: small enough to test, large enough for every honest request here


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- a second frontend, to see each path answered in its owner's shape --------------------


class Ping(msgspec.Struct):
    text: str


class MessagesLike:
    """Owns /v1/messages the way the Anthropic frontend does, with its error shape."""

    name = "messages-like"
    description = "a test frontend owning /v1/messages"
    error_paths = ("/v1/messages",)

    def supports(self, device) -> Support:
        return Support.yes()

    def route_handlers(self, state) -> list:
        @post("/v1/messages", status_code=200)
        async def messages(data: JSONBody[Ping]) -> dict:
            return {"echo": data.text}

        return [messages]

    def error_body(self, error: ApiError) -> dict:
        return {"type": "error", "error": {"type": f"{error.kind}_error", "message": error.message}}


class MessagesLikePlugin:
    @staticmethod
    @hookimpl
    def register_frontends():
        return [MessagesLike()]


def openai_host(*extra: tuple[str, object]):
    """The OpenAI frontend and `extra` only (no Anthropic frontend: it would claim
    /v1/messages too)."""
    return frontends_host(*extra, anthropic=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_serve_model(tmp_path_factory.mktemp("serve-http-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    state = make_state(model_dir, max_concurrency=4, max_pending_requests=64, kv_capacity=8192)
    host = openai_host(("messages-like", MessagesLikePlugin))
    with serving(state, host, api_key=KEY, max_request_mib=LIMIT_MIB) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}


def openai_error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


# -- error shapes and auth -----------------------------------------------------------------


def test_the_longest_owning_prefix_shapes_the_error():
    shapes = ErrorShapes()
    shapes.add("/v1", "openai", lambda e: {"who": "openai"})
    shapes.add("/v1/messages", "anthropic", lambda e: {"who": "anthropic"})
    error = ApiError(400, "invalid_request", "bad")
    paths = ("/v1/models", "/v1/messages", "/v1/messages/count_tokens", "/v1/messagesx", "/metrics")
    who = {p: shapes.body_for(p)(error).get("who") for p in paths}
    assert who == {"/v1/models": "openai", "/v1/messages": "anthropic",
                   "/v1/messages/count_tokens": "anthropic", "/v1/messagesx": "openai",
                   "/metrics": None}  # fmt: skip
    assert shapes.body_for("/metrics")(error) == {
        "error": {"type": "invalid_request", "message": "bad"}
    }
    with pytest.raises(ValueError, match="'openai' and 'other' both claim"):
        shapes.add("/v1/", "other", lambda e: {})


def test_auth_accepts_bearer_or_x_api_key_and_exemptshealth_status(server):
    url = server.url
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    # /health answers anyone, but says what the server runs only to a client with a key
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/health", headers={"x-api-key": "nope"}).json() == {"status": "ok"}
    assert httpx.get(url + "/health", headers=AUTH).json()["model"] == MODEL_ID
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": KEY + "x"},
                    {"Authorization": f"Basic {KEY}"}):  # fmt: skip
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 401 and openai_error(r)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/metrics").status_code == 401
    # an unknown path is as closed as a known one: 401 without a key, 404 with it
    assert httpx.get(url + "/v1/nowhere").status_code == 401
    assert httpx.get(url + "/v1/nowhere", headers=AUTH).status_code == 404
    # two different keys in one request are no key (which one counts would be a guess)
    two = [("x-api-key", "nope"), ("x-api-key", KEY)]
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=two)
    assert r.status_code == 401 and "more than one API key" in openai_error(r)["message"]
    both = [("x-api-key", KEY), ("authorization", f"Bearer {KEY}")]
    assert httpx.get(url + "/v1/models", headers=both).status_code == 200


def test_each_protocol_answers_in_its_own_shape(server):
    r = httpx.post(server.url + "/v1/messages", json={"text": "x"})
    assert r.status_code == 401
    error = r.json()["error"]
    assert r.json() == {"type": "error", "error": {**error, "type": "authentication_error"}}
    r = httpx.post(server.url + "/v1/messages", json={"text": 5}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "`text`" in r.json()["error"]["message"]
    big = {"text": "x" * int(LIMIT_MIB * 2**20)}
    r = httpx.post(server.url + "/v1/messages", json=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large_error"
    ok = httpx.post(server.url + "/v1/messages", json={"text": "x"}, headers=AUTH)
    assert ok.json() == {"echo": "x"}


def test_cors_preflight_needs_no_key(model_dir):
    app = create_app(None, openai_host(), api_key=KEY, cors=["http://app.example"])
    with ServerThread(app) as srv:
        r = httpx.options(srv.url + "/v1/models", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "authorization"})  # fmt: skip
        assert r.status_code in (200, 204)
        assert r.headers["access-control-allow-origin"] == "http://app.example"


# -- health and metrics --------------------------------------------------------------------


def test_health_is_503_while_loading_then_200(model_dir):
    app = create_app(None, openai_host())
    loops: list[asyncio.AbstractEventLoop] = []
    app.on_startup.append(lambda: loops.append(asyncio.get_running_loop()))
    state = make_state(model_dir)
    with ServerThread(app) as srv:
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        early = httpx.post(srv.url + "/v1/chat/completions", json=CHAT)
        assert early.status_code == 503 and early.headers["retry-after"]
        assert openai_error(early)["code"] == "service_unavailable"
        loops[0].call_soon_threadsafe(attach_state, app, state)
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 200)
        assert httpx.get(srv.url + "/health").json() == {"status": "ok", "model": MODEL_ID}
        assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200
        schema = httpx.get(srv.url + "/schema/openapi.json").json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(schema["paths"])
    state.engine.close()


def metric(text: str, name: str) -> float:
    """An unlabelled sample's value from the Prometheus text format."""
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    raise AssertionError(f"{name} not in the metrics")


def test_metrics_count_requests_tokens_and_pages(client, server):
    client.chat.completions.create(model=MODEL_ID, messages=CHAT["messages"], max_tokens=4,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert 'ninfer_http_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert metric(text, "ninfer_time_to_first_token_seconds_count") >= 1
    assert metric(text, "ninfer_inter_token_latency_seconds_count") >= 3
    assert metric(text, "ninfer_generated_tokens_total") >= 4
    assert metric(text, "ninfer_prompt_tokens_total") >= 9
    assert "ninfer_cached_prompt_tokens_total" in text
    engine = server.state.engine
    assert metric(text, "ninfer_kv_pages_free") + metric(text, "ninfer_kv_pages_used") == (
        engine.block_manager.num_blocks)  # fmt: skip
    assert metric(text, "ninfer_queue_depth") == 0 and metric(text, "ninfer_running_sequences") == 0


# -- bad input -----------------------------------------------------------------------------


def with_(base: dict, **changes) -> bytes:
    body = {k: v for k, v in {**base, **changes}.items() if v is not DROP}
    return json.dumps(body).encode()


DROP = object()
COMMON = {  # case -> (body for chat, body for completions)
    "malformed JSON": (b'{"model": ', b'{"model": '),
    "invalid UTF-8": (
        b'{"model": "\xff\xfe", "messages": []}',
        b'{"model": "\xff", "prompt": "x"}',
    ),
    "empty body": (b"", b""),
    "not an object": (b"[1, 2]", b"[1, 2]"),
    "null": (b"null", b"null"),
    "unknown model": (with_(CHAT, model="nope"), with_(COMPLETION, model="nope")),
    "model not a string": (with_(CHAT, model=123), with_(COMPLETION, model=123)),
    "stream not a bool": (with_(CHAT, stream="yes"), with_(COMPLETION, stream="yes")),
    "temperature not a number": (
        with_(CHAT, temperature="hot"),
        with_(COMPLETION, temperature="hot"),
    ),
    "temperature negative": (with_(CHAT, temperature=-1), with_(COMPLETION, temperature=-1)),
    "temperature overflows": (
        with_(CHAT).replace(b"}", b', "temperature": 1e999}'),
        with_(COMPLETION).replace(b"}", b', "temperature": 1e999}'),
    ),
    "top_p zero": (with_(CHAT, top_p=0), with_(COMPLETION, top_p=0)),
    "max_tokens not an int": (with_(CHAT, max_tokens=[1]), with_(COMPLETION, max_tokens=1.5)),
    "max_tokens negative": (with_(CHAT, max_tokens=-5), with_(COMPLETION, max_tokens=0)),
    "max_tokens huge": (with_(CHAT, max_tokens=10**30), with_(COMPLETION, max_tokens=10**30)),
    "n huge": (with_(CHAT, n=10**20), with_(COMPLETION, n=0)),
    "seed not an int": (with_(CHAT, seed="abc"), with_(COMPLETION, seed=[1])),
    "stop too many": (with_(CHAT, stop=["x"] * 65), with_(COMPLETION, stop=["x"] * 65)),
    "stop too long": (with_(CHAT, stop=["x" * 257]), with_(COMPLETION, stop="x" * 257)),
    "stop empty": (with_(CHAT, stop=[""]), with_(COMPLETION, stop="")),
    "stop not strings": (with_(CHAT, stop=[1]), with_(COMPLETION, stop={"a": 1})),
    "logit_bias": (with_(CHAT, logit_bias={"1": 5}), with_(COMPLETION, logit_bias={"1": 5})),
    "over the body limit": (with_(CHAT, user="x" * 60_000), with_(COMPLETION, user="x" * 60_000)),
}
CHAT_ONLY = {
    "missing messages": with_(CHAT, messages=DROP),
    "empty messages": with_(CHAT, messages=[]),
    "messages not a list": with_(CHAT, messages="hi"),
    "unknown role": with_(CHAT, messages=[{"role": "wizard", "content": "hi"}]),
    "message without role": with_(CHAT, messages=[{"content": "hi"}]),
    "content not text": with_(CHAT, messages=[{"role": "user", "content": 5}]),
    "user without content": with_(CHAT, messages=[{"role": "user"}]),
    "image part": with_(
        CHAT,
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
            }
        ],
    ),
    "tools not a list": with_(CHAT, tools="get_weather"),
    "tool without a function": with_(CHAT, tools=[{"type": "function"}]),
    "tool_choice unknown": with_(CHAT, tool_choice="sometimes"),
    "tool_choice without tools": with_(CHAT, tool_choice="required"),
    "top_logprobs over 20": with_(CHAT, logprobs=True, top_logprobs=21),
    "top_logprobs without logprobs": with_(CHAT, top_logprobs=2),
    "unknown response format": with_(CHAT, response_format={"type": "xml"}),
    "reserved template kwarg": with_(CHAT, chat_template_kwargs={"add_generation_prompt": False}),
    "tool call arguments not text": with_(
        CHAT,
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}
                ],
            },
        ],
    ),
}
COMPLETION_ONLY = {
    "missing prompt": with_(COMPLETION, prompt=DROP),
    "empty prompt": with_(COMPLETION, prompt=""),
    "empty token list": with_(COMPLETION, prompt=[]),
    "token id outside the vocabulary": with_(COMPLETION, prompt=[10**12]),
    "negative token id": with_(COMPLETION, prompt=[-1]),
    "mixed prompt": with_(COMPLETION, prompt=[1, "a"]),
    "two prompts": with_(COMPLETION, prompt=["a", "b"]),
    "prompt an object": with_(COMPLETION, prompt={"text": "a"}),
    "suffix": with_(COMPLETION, suffix="end"),
    "best_of": with_(COMPLETION, best_of=3),
}
CASES = [
    *[("/v1/chat/completions", name, bodies[0]) for name, bodies in COMMON.items()],
    *[("/v1/completions", name, bodies[1]) for name, bodies in COMMON.items()],
    *[("/v1/chat/completions", name, body) for name, body in CHAT_ONLY.items()],
    *[("/v1/completions", name, body) for name, body in COMPLETION_ONLY.items()],
]


@pytest.mark.parametrize(("path", "case", "body"), CASES, ids=[f"{p}: {c}" for p, c, _ in CASES])
def test_bad_input_is_a_4xx_in_openai_shape(server, path, case, body):
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(server.url + path, content=body, headers=headers)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    openai_error(r)
    expected = {"unknown model": 404, "over the body limit": 413}.get(case, 400)
    assert r.status_code == expected, r.text
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200


def test_bad_paths_and_methods(server):
    for method, path, status in (("GET", "/v1/models/nope", 404), ("GET", "/v1/nothing", 404),
                                 ("GET", "/v1/chat/completions", 405),
                                 ("DELETE", "/v1/models", 405)):  # fmt: skip
        r = httpx.request(method, server.url + path, headers=AUTH)
        assert r.status_code == status and openai_error(r)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    size = int(LIMIT_MIB * 2**20) + 1

    def chunks():  # chunked: no Content-Length, counted as it arrives
        for _ in range(size // 1000 + 1):
            yield b" " * 1000

    for content in (b" " * size, chunks()):
        r = httpx.post(server.url + "/v1/chat/completions", content=content, headers=AUTH)
        assert r.status_code == 413 and openai_error(r)["code"] == "request_too_large"
    # 10 GiB declared, none sent: the answer comes without waiting for a byte of it
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}"
                     f"\r\nContent-Length: {10 * 2**30}\r\n\r\n".encode())  # fmt: skip
        assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")


def test_the_server_still_serves_after_bad_input(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT["messages"], max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


# -- disconnects and overload --------------------------------------------------------------


def test_fifty_streams_dropped_mid_way_give_their_pages_back(client, server):
    engine = server.state.engine
    idle = lambda: not engine.scheduler.running and not engine.scheduler.waiting  # noqa: E731
    wait_for(idle)
    baseline = engine.block_manager.num_used_blocks
    before = httpx.get(server.url + "/metrics", headers=AUTH).text
    decoded_before = engine.counters.decode_tokens

    def drop(i: int) -> None:
        stream = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": f"story number {i}"}],
            max_tokens=400, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks), next(chunks), next(chunks)  # role, then tokens: it is running
        stream.close()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(drop, range(50)))
    wait_for(idle)
    assert engine.block_manager.num_used_blocks == baseline
    engine.check_invariants()
    assert engine.counters.decode_tokens - decoded_before < 50 * 400 / 4  # cut short, not run out
    after = httpx.get(server.url + "/metrics", headers=AUTH).text
    cancelled = 'ninfer_generations_total{reason="cancelled"}'
    count = lambda text: metric(text, cancelled) if cancelled in text else 0.0  # noqa: E731
    assert count(after) - count(before) == 50


def test_a_client_leaving_before_the_answer_cancels_it(server):
    engine = server.state.engine
    body = {**CHAT, "max_tokens": 1500, "ignore_eos": True}
    start = engine.counters.decode_tokens
    with pytest.raises(httpx.ReadTimeout):  # not streamed: it gives up waiting, and closes
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=0.3)
    wait_for(lambda: not engine.scheduler.running, timeout=10)
    assert engine.counters.decode_tokens - start < 1000


@pytest.fixture(scope="module")
def tight_server(model_dir):
    """One running, one queued for at most 0.5 s: the overload cases."""
    state = make_state(model_dir, max_concurrency=1, max_pending_requests=1, pending_timeout_ms=500)
    with serving(state, openai_host()) as srv:
        yield srv


def test_overload_is_429_at_once_and_a_queue_timeout_503(tight_server):
    engine = tight_server.state.engine
    with openai.OpenAI(base_url=tight_server.url + "/v1", api_key="-", max_retries=0) as client:
        overload_cases(client, engine)


def overload_cases(client: openai.OpenAI, engine) -> None:
    messages = CHAT["messages"]
    running = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=1900, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(running)
    next(chunks), next(chunks)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(
            client.chat.completions.create, model=MODEL_ID, messages=messages, max_tokens=4
        )
        wait_for(lambda: len(engine.scheduler.waiting) == 1)
        start = time.monotonic()
        with pytest.raises(openai.RateLimitError) as third:
            client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4)
        assert time.monotonic() - start < 0.4  # at once, not after a wait
        assert int(third.value.response.headers["retry-after"]) >= 1
        assert third.value.body["type"] == "rate_limit_error"
        with pytest.raises(openai.InternalServerError) as timed_out:
            queued.result()
    assert timed_out.value.status_code == 503
    assert int(timed_out.value.response.headers["retry-after"]) >= 1
    assert timed_out.value.body["code"] == "request_queue_timeout"
    assert next(chunks).choices[0].finish_reason is None  # the running one never noticed
    running.close()
    wait_for(lambda: not engine.scheduler.running)
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert engine.block_manager.num_used_blocks == 0


# -- the command ---------------------------------------------------------------------------

ISSUE_OPTIONS = (
    "--host", "--port", "--model-id", "--api-key", "--max-context", "--kv-capacity",
    "--max-concurrency", "--max-pending-requests", "--pending-timeout-ms", "--prefill-chunk",
    "--kv-dtype", "--spec", "--draft-tokens", "--lm-head-draft", "--default-max-tokens",
    "--max-request-mib", "--cors", "--temperature", "--top-p", "--top-k", "--min-p",
    "--no-prefix-cache",
)  # fmt: skip


def test_the_command_has_the_options_people_copy(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    out = capsys.readouterr().out
    assert [o for o in ISSUE_OPTIONS if o not in out] == []


@pytest.mark.parametrize("option", [["--draft-tokens", "3"], ["--lm-head-draft"]])
def test_speculative_modifiers_without_a_strategy_are_refused(option, capsys):
    assert serve_main(option) == 2
    err = capsys.readouterr().err
    assert option[0] in err and "needs --spec" in err


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("nope", ("nope", "ngram", "mtp")),
        # the model has no MTP layer: refused before serving, with the strategy that works
        ("mtp", ("--spec mtp", "MTP", "ngram")),
    ],
)
def test_a_strategy_that_cannot_run_fails_at_startup(model_dir, spec, words):
    proc = serve_process(model_dir, "--port", str(free_port()), "--spec", spec)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("ninfer-serve: error:") and all(w in line for w in words), line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_starts_reports_and_shuts_down_cleanly_on_sigterm(model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stack = contextlib.ExitStack()
    proc = serve_process(model_dir, "--port", str(port), "--model-id", "tiny",
                         "--graceful-shutdown-s", "0.5")  # fmt: skip
    try:
        wait_for(lambda: proc.poll() is None and health_status(url) == 200, timeout=60)
        client = stack.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="-"))
        stream = client.chat.completions.create(
            model="tiny", messages=CHAT["messages"], max_tokens=900, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks), next(chunks)
        proc.send_signal(signal.SIGTERM)
        # it finishes within its grace time, or is cut when that is over
        with contextlib.suppress(openai.APIError, httpx.HTTPError):
            for _ in chunks:
                pass
        out, err = proc.communicate(timeout=30)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
        print(f"ninfer-serve said:\n{out}\n{err}")  # shown with the failure
        raise
    finally:
        stack.close()
    assert proc.returncode == 0, err
    for line in ("listening on " + url, "KV pool: 64 pages x 16 tokens", "ready: " + url):
        assert line in out, out
    assert "kv codecs: fp32" in out


def test_a_loopback_server_answers_only_hosts_of_loopback(model_dir):
    """DNS rebinding: a page whose own name resolves to 127.0.0.1 sends `Host: its name`;
    a server listening on loopback refuses it, in the protocol's shape, and answers
    `localhost`, `127.0.0.1` and `[::1]` at any port."""
    from ninfer_core.serve.hosts import allowed_hosts, host_name

    assert allowed_hosts(None, ["127.0.0.1"]) == ["localhost", "127.0.0.1", "::1"]
    assert allowed_hosts(None, ["127.0.0.1", "0.0.0.0"]) is None
    assert allowed_hosts("a.example, *", ["127.0.0.1"]) is None
    assert host_name(b"[::1]:8000") == "::1" and host_name(b"LocalHost:1") == "localhost"
    state = make_state(model_dir)
    app = create_app(state, openai_host(), hosts=allowed_hosts(None, ["127.0.0.1"]))
    with ServerThread(app) as srv:
        for name in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", ""):
            r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"host": name})
            assert r.status_code == 400, name
            assert "does not answer to Host" in openai_error(r)["message"]
        for name in ("localhost:1234", "127.0.0.1", "[::1]:80", "127.0.0.2"):
            r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"host": name})
            assert r.status_code == 200, (name, r.text)
    state.engine.close()
