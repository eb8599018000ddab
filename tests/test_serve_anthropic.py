"""The Anthropic frontend behind a real uvicorn server, driven by the official SDK.

A tiny random model cannot be asked for a tool call or a think block, so those tests
script its output: the engine's sampler is swapped for one that emits the token ids of
a fixed text. Everything after the sampler — detokenizer, stop strings, `<think>` and
tool-call parsing, the wire format, the SDK's own parsing — is the real path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import pytest
import torch
import uvicorn
from litestar import Litestar
from serve_fixtures import MODEL_ID, make_state, write_serve_model
from tokenizers import Tokenizer as ReferenceTokenizer

import ninfer_plugins.frontend_anthropic as plugin
from ninfer_core.engine.request import OverloadedError
from ninfer_core.plugin_host import create_host
from ninfer_core.plugin_types import Frontend
from ninfer_core.serve.app import create_app
from ninfer_core.serve.errors import ApiError
from ninfer_plugins.frontend_anthropic import AnthropicFrontend, register_frontends
from ninfer_plugins.frontend_anthropic.blocks import BlockAssembler

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
HELLO = [{"role": "user", "content": "Hello world! What is the weather like in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_serve_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def state(model_dir):
    state = make_state(model_dir)
    yield state
    state.engine.close()


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """A real server on a free port: the SDK sees exactly what a deployment sends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def url(state) -> Iterator[str]:
    """The frontend's routes alone, in a litestar app of their own."""
    frontend = AnthropicFrontend(ping_interval_s=0.2)
    with serve(Litestar(route_handlers=frontend.route_handlers(state))) as url:
        yield url


@pytest.fixture
def client(url) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as client:
        yield client


class ScriptedSampler:
    """Emits `ids` then end-of-turn; records the prompt it was asked to continue."""

    def __init__(self, ids: list[int], end: int, delay_s: float = 0.0) -> None:
        self.ids, self.end, self.delay_s = ids, end, delay_s
        self.prompts: list[tuple[int, ...]] = []

    def sample(self, logits, params, histories):
        if self.delay_s:  # a slow prefill, as a long prompt on a real model would be
            time.sleep(self.delay_s)
            self.delay_s = 0.0
        out = []
        for history in histories:
            n = len(history.output_ids)
            if n == 0:
                self.prompts.append(history.prompt_ids)
            out.append(self.ids[n] if n < len(self.ids) else self.end)
        return torch.tensor(out, dtype=torch.long)


@pytest.fixture
def script(state, monkeypatch):
    """`script(text)`: the model's next answers are `text`; returns the sampler."""

    def use(text: str, delay_s: float = 0.0) -> ScriptedSampler:
        tok = state.tokenizer
        sampler = ScriptedSampler(tok.encode(text, add_special_tokens=False),
                                  tok.token_to_id("<|im_end|>"), delay_s)  # fmt: skip
        monkeypatch.setattr(state.engine.postprocess, "sampler", sampler)
        return sampler

    return use


def prompt_text(state, sampler: ScriptedSampler) -> str:
    return state.tokenizer.decode(sampler.prompts[-1])


def sse(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event, data) pairs of a raw SSE body."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
    return events


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def blocks(message) -> list[dict]:
    return [
        {k: v for k, v in b.model_dump().items() if v is not None and k not in ("id", "citations")}
        for b in message.content
    ]


# -- the plugin ----------------------------------------------------------------------------


def host_with_the_frontend():
    """A plugin host that loads this frontend the way its entry point does."""
    host = create_host(load_entry_points=False, extra_plugins=[("frontend-anthropic", plugin)])
    assert not host.failures
    return host


def test_register_frontends_returns_the_anthropic_frontend():
    (frontend,) = register_frontends()
    assert isinstance(frontend, Frontend) and frontend.name == "anthropic"
    assert frontend.description and frontend.supports(None)
    assert frontend.error_paths == ("/v1/messages",)
    assert host_with_the_frontend().frontends.names() == ["anthropic"]


@pytest.mark.parametrize(
    ("status", "kind", "expected"),
    [
        (400, "invalid_request", "invalid_request_error"),
        (400, "context_length_exceeded", "invalid_request_error"),
        (401, "authentication", "authentication_error"),
        (404, "not_found", "not_found_error"),
        (413, "request_too_large", "request_too_large"),
        (429, "overloaded", "rate_limit_error"),
        (503, "queue_timeout", "overloaded_error"),
        (503, "unavailable", "overloaded_error"),
        (500, "internal", "api_error"),
        (405, "something new", "invalid_request_error"),
        (502, "something new", "api_error"),
    ],
)
def test_error_bodies_use_anthropics_type_names(status, kind, expected):
    body = AnthropicFrontend().error_body(ApiError(status, kind, "what happened"))
    assert body == {"type": "error", "error": {"type": expected, "message": "what happened"}}


OUTPUT = (
    "<think>\nTwo cities.\n</think>\n\nLet me check.  \n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "</function>\n</tool_call>\nDone."
)


@pytest.mark.parametrize("seed", range(5))
def test_blocks_do_not_depend_on_how_the_text_was_cut(seed):
    def assemble(pieces):
        blocks = BlockAssembler([{"name": "get_weather", "input_schema": WEATHER["input_schema"]}],
                                parse_tools=True)  # fmt: skip
        events = [e for piece in pieces for e in blocks.feed(piece)] + blocks.finish()
        return [{k: v for k, v in b.items() if k != "id"} for b in blocks.blocks], events

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(OUTPUT)), 40))
    pieces = [OUTPUT[i:j] for i, j in zip([0, *cuts], [*cuts, len(OUTPUT)], strict=True)]
    whole, _ = assemble([OUTPUT])
    cut, events = assemble(pieces)
    call = {"type": "tool_use", "name": "get_weather"}
    assert (
        whole
        == cut
        == [
            {"type": "thinking", "thinking": "Two cities.", "signature": ""},
            {"type": "text", "text": "Let me check."},
            call | {"input": {"city": "Paris"}},
            call | {"input": {"city": "Oslo"}},
            {"type": "text", "text": "Done."},
        ]
    )
    # The events rebuild the blocks, as a streaming client does.
    rebuilt: list[dict] = []
    for event in events:
        if event["type"] == "content_block_start":
            rebuilt.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], rebuilt[event["index"]]
            if delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] += delta[key]
    assert [{k: v for k, v in b.items() if k != "id"} for b in rebuilt] == whole
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == list(range(5))


def test_a_continued_prefill_keeps_its_leading_space():
    blocks = BlockAssembler(None, parse_tools=False)
    for piece in (" ", "4", ".\n"):
        blocks.feed(piece)
    blocks.finish()
    assert blocks.blocks == [{"type": "text", "text": " 4."}]


# -- plain and streamed ----------------------------------------------------------------------


def test_streamed_text_equals_plain_text_and_usage_counts_the_prompt(client, state, model_dir):
    kw = dict(model=MODEL_ID, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert plain.type == "message" and plain.role == "assistant" and plain.model == MODEL_ID
    assert text_of(streamed) == text_of(plain)
    assert streamed.stop_reason == plain.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= plain.usage.output_tokens == streamed.usage.output_tokens <= 12
    rendered = state.template.render(HELLO, add_generation_prompt=True)
    count = len(ReferenceTokenizer.from_file(str(model_dir / "tokenizer.json")).encode(rendered))
    for message in (plain, streamed):
        u = message.usage  # Anthropic's three parts add up to the prompt
        assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == count
    assert client.messages.count_tokens(model=MODEL_ID, messages=HELLO).input_tokens == count


def test_the_event_sequence_is_anthropics(url, script):
    script("Hello world!")
    body = {"model": MODEL_ID, "max_tokens": 50, "stream": True, "messages": HELLO}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
    names = [name for name, _ in events if name != "ping"]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert [name for name, data in events if name == data["type"]] == [n for n, _ in events]
    assert events[1][0] == "ping"  # one right after message_start
    delta = dict(events)["message_delta"]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0


def test_pings_keep_a_waiting_stream_alive(url, script):
    script("Hi", delay_s=1.2)  # the frontend pings every 0.2 s of silence here
    body = {"model": MODEL_ID, "max_tokens": 5, "stream": True, "messages": HELLO}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=30) as response:
        names = [name for name, _ in sse(response)]
    first_block = names.index("content_block_start")
    assert names[:2] == ["message_start", "ping"] and names[:first_block].count("ping") >= 3


# -- tools -----------------------------------------------------------------------------------

JSON_CALL = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call>"
)
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (JSON_CALL, ([{"type": "text", "text": "Let me check."}], {"city": "Paris"})),
        (XML_CALL, ([], {"city": "Paris", "days": 2})),
    ],
    ids=["json", "xml"],
)
def test_tool_use_round_trip(client, state, script, output, expected):
    text_blocks, arguments = expected
    sampler = script(output)
    kw = dict(model=MODEL_ID, max_tokens=200, messages=HELLO, tools=[WEATHER])
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert "get_weather" in prompt_text(state, sampler)  # the template told the model
    call = {"type": "tool_use", "name": "get_weather", "input": arguments}
    for message in (plain, streamed):
        assert message.stop_reason == "tool_use" and blocks(message) == [*text_blocks, call]
    tool_use = plain.content[-1]
    assert tool_use.id.startswith("toolu_")

    sampler = script("It is 21 degrees in Paris.")
    history = [
        *HELLO,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in plain.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                      "content": [{"type": "text", "text": "21 C, clear"}]}]},
    ]  # fmt: skip
    final = client.messages.create(model=MODEL_ID, max_tokens=50, messages=history,
                                   tools=[WEATHER])  # fmt: skip
    assert final.stop_reason == "end_turn" and text_of(final) == "It is 21 degrees in Paris."
    prompt = prompt_text(state, sampler)
    assert "<tool_response>\n21 C, clear\n</tool_response>" in prompt
    args = json.dumps(arguments)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>' in prompt


def test_tool_choice_none_drops_the_tools_and_malformed_calls_stay_text(client, state, script):
    sampler = script(JSON_CALL)
    message = client.messages.create(model=MODEL_ID, max_tokens=200, messages=HELLO,
                                     tools=[WEATHER], tool_choice={"type": "none"})  # fmt: skip
    assert "get_weather" not in prompt_text(state, sampler)
    assert message.stop_reason == "end_turn" and text_of(message) == JSON_CALL
    script('<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call> ok')
    message = client.messages.create(model=MODEL_ID, max_tokens=200, messages=HELLO,
                                     tools=[WEATHER])  # fmt: skip
    assert message.stop_reason == "end_turn" and "<tool_call>" in text_of(message)


# -- stops, thinking, prefill ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, script, stream):
    script("Hello world! The quick brown fox jumps over the lazy dog.")
    kw = dict(model=MODEL_ID, max_tokens=100, messages=HELLO, stop_sequences=["fox", "brown"])
    if stream:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kw)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "brown"
    assert text_of(message) == "Hello world! The quick"


def test_thinking_is_split_into_its_own_block(client, state, script):
    sampler = script("<think>\nLet me think.\n</think>\n\nThe answer is 4.")
    kw = dict(model=MODEL_ID, max_tokens=100, messages=HELLO,
              thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    expected = [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "The answer is 4."},
    ]
    assert blocks(plain) == blocks(streamed) == expected
    assert "<think>" not in prompt_text(state, sampler)
    client.messages.create(**kw | {"thinking": {"type": "disabled"}})
    assert prompt_text(state, sampler).endswith("<think>\n\n</think>\n\n")


def test_an_assistant_prefill_is_continued(client, state, script):
    # The Qwen-style template leaves the prompt inside <think> here, so the answer starts
    # in a thought without ever writing the opening tag.
    sampler = script("Pondering.\n</think>\n\nDone.")
    message = client.messages.create(
        model=MODEL_ID, max_tokens=50,
        messages=[*HELLO, {"role": "assistant", "content": "<think>\n"}],
    )  # fmt: skip
    assert not prompt_text(state, sampler).endswith("<|im_start|>assistant\n")
    assert blocks(message) == [
        {"type": "thinking", "thinking": "Pondering.", "signature": ""},
        {"type": "text", "text": "Done."},
    ]


def test_max_tokens_shrinks_to_the_context_left(client, state, script):
    """As Anthropic's API does for agents that always ask for the same large budget."""
    script("Hello world! " * 400)
    long = [{"role": "user", "content": "The quick brown fox. " * 180}]
    prompt = client.messages.count_tokens(model=MODEL_ID, messages=long).input_tokens
    assert 1900 < prompt < state.max_context - 8
    message = client.messages.create(model=MODEL_ID, max_tokens=state.max_context, messages=long)
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.output_tokens == state.max_context - prompt
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client.messages.create(model=MODEL_ID, max_tokens=state.max_context + 1, messages=long)


def test_count_tokens_matches_what_a_request_renders(client, state):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind."}]
    got = client.messages.count_tokens(model=MODEL_ID, system=system, messages=HELLO,
                                       tools=[WEATHER]).input_tokens  # fmt: skip
    function = {"name": WEATHER["name"], "parameters": WEATHER["input_schema"],
                "description": WEATHER["description"]}  # fmt: skip
    messages = [{"role": "system", "content": "You are terse.\n\nBe kind."}, *HELLO]
    assert got == len(state.render(messages, [{"type": "function", "function": function}]))
    assert (
        got
        == client.messages.count_tokens(
            model=MODEL_ID, system="You are terse.\n\nBe kind.", messages=HELLO, tools=[WEATHER]
        ).input_tokens
    )


# -- errors --------------------------------------------------------------------------------

OK = {"model": MODEL_ID, "max_tokens": 5, "messages": HELLO}
BAD = [
    ("bad json", b'{"model": ', 400, "invalid_request_error"),
    ("not an object", b"[1, 2]", 400, "invalid_request_error"),
    ("no body", b"", 400, "invalid_request_error"),
    ("invalid utf-8", b'{"model": "\xff\xfe"}', 400, "invalid_request_error"),
    ("max_tokens missing", {"model": MODEL_ID, "messages": HELLO}, 400, "invalid_request_error"),
    ("max_tokens a word", OK | {"max_tokens": "five"}, 400, "invalid_request_error"),
    ("max_tokens zero", OK | {"max_tokens": 0}, 400, "invalid_request_error"),
    ("max_tokens huge", OK | {"max_tokens": 10**30}, 400, "invalid_request_error"),
    ("messages not a list", OK | {"messages": "hi"}, 400, "invalid_request_error"),
    ("empty messages", OK | {"messages": []}, 400, "invalid_request_error"),
    ("unknown role", OK | {"messages": [{"role": "system", "content": "x"}]}, 400,
     "invalid_request_error"),
    ("unknown block", OK | {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
     400, "invalid_request_error"),
    ("image", OK | {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    ]}]}, 400, "invalid_request_error"),
    ("temperature negative", OK | {"temperature": -1}, 400, "invalid_request_error"),
    ("top_p too big", OK | {"top_p": 7}, 400, "invalid_request_error"),
    ("tool_choice unknown tool", OK | {"tools": [WEATHER], "tool_choice":
        {"type": "tool", "name": "nope"}}, 400, "invalid_request_error"),
    ("server tool", OK | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error"),
    ("unknown model", OK | {"model": "claude-opus"}, 404, "not_found_error"),
]  # fmt: skip


#: count_tokens takes no generation settings; every other case applies to both routes.
SETTINGS = ("max_tokens", "temperature", "top_p")
CASES = [("/v1/messages", *case) for case in BAD] + [
    ("/v1/messages/count_tokens", *case) for case in BAD if not case[0].startswith(SETTINGS)
]


@pytest.mark.parametrize(
    ("path", "case", "body", "status", "kind"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES]
)
def test_bad_requests_answer_in_anthropics_error_shape(url, path, case, body, status, kind):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{url}{path}", content=content, timeout=30,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert isinstance(error["error"]["message"], str) and error["error"]["message"]


def test_errors_reach_the_sdk_as_its_own_exceptions_and_the_server_keeps_serving(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-opus", max_tokens=5, messages=HELLO)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="image content is not supported"):
        image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
        client.messages.create(
            model=MODEL_ID, max_tokens=5, messages=[{"role": "user", "content": [image]}]
        )
    assert client.messages.create(model=MODEL_ID, max_tokens=3, messages=HELLO).usage


def test_a_full_queue_is_a_429_before_the_stream_starts(client, state, monkeypatch):
    def refuse(request):
        raise OverloadedError("16 requests are queued", retry_after=3)

    monkeypatch.setattr(state.engine, "submit", refuse)
    stream = client.messages.stream(model=MODEL_ID, max_tokens=5, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as caught, stream as s:
        s.get_final_message()
    assert caught.value.response.headers["retry-after"] == "3"
    assert caught.value.body["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("after_s", [0.05, 0.5], ids=["before-the-stream", "mid-stream"])
def test_a_queue_timeout_is_a_503_or_an_error_event(url, state, monkeypatch, after_s):
    """Within the first ping interval (0.2 s here) it still gets its HTTP status."""

    async def times_out(request):
        await asyncio.sleep(after_s)
        raise ApiError(503, "queue_timeout", "waited 900 s", headers={"Retry-After": "5"})
        yield  # an async generator, like ServeState.generate

    monkeypatch.setattr(state, "generate", times_out)
    with httpx.stream("POST", f"{url}/v1/messages", json=OK | {"stream": True}) as response:
        if after_s < 0.2:
            assert response.status_code == 503 and response.headers["retry-after"] == "5"
            response.read()
            assert response.json()["error"]["type"] == "overloaded_error"
            return
        assert response.status_code == 200
        events = sse(response)
    assert [name for name, _ in events if name != "ping"] == ["message_start", "error"]
    assert events[-1][1]["error"]["type"] == "overloaded_error"


# -- disconnects ---------------------------------------------------------------------------


def test_a_client_that_goes_away_cancels_its_request(url, state, script, monkeypatch):
    engine = state.engine
    baseline = engine.block_manager.num_used_blocks
    cancelled: set[str] = set()  # requests that were still running when cancelled
    cancel = engine.cancel
    monkeypatch.setattr(engine, "cancel", lambda rid: cancel(rid) and cancelled.add(rid))
    script("Hello world! " * 400)  # far longer than the test waits
    body = {"model": MODEL_ID, "max_tokens": 1500, "messages": HELLO}

    def wait_for_baseline():
        deadline = time.monotonic() + 5
        while engine.has_work or engine.block_manager.num_used_blocks != baseline:
            assert time.monotonic() < deadline, "the request kept running after the disconnect"
            time.sleep(0.02)

    for _ in range(3):  # mid-stream
        with httpx.stream("POST", f"{url}/v1/messages", json=body | {"stream": True}) as r:
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("event: content_block_delta")
                if deltas == 3:
                    break
        wait_for_baseline()
    with pytest.raises(httpx.ReadTimeout):  # waiting for a whole answer, then not
        httpx.post(f"{url}/v1/messages", json=body, timeout=0.5)
    wait_for_baseline()
    assert len(cancelled) == 4
    engine.check_invariants()


# -- inside the server core's app -------------------------------------------------------------


def test_in_the_core_app_auth_and_body_limits_answer_in_anthropics_shape(state):
    app = create_app(state, host_with_the_frontend(), api_key="sesame", max_request_mib=0.01)
    with serve(app) as url:
        stranger = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
        with stranger, pytest.raises(anthropic.AuthenticationError) as caught:
            stranger.messages.create(model=MODEL_ID, max_tokens=5, messages=HELLO)
        assert caught.value.body["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=url, api_key="sesame", max_retries=0) as client:
            with pytest.raises(anthropic.APIStatusError) as caught:
                big = [{"role": "user", "content": "x" * 20_000}]
                client.messages.create(model=MODEL_ID, max_tokens=5, messages=big)
            assert caught.value.status_code == 413
            assert caught.value.body["error"]["type"] == "request_too_large"
            with client.messages.stream(model=MODEL_ID, max_tokens=4, messages=HELLO) as s:
                assert s.get_final_message().usage.output_tokens >= 1
