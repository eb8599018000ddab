"""Protocol edges other servers' test suites and an adversarial pass caught (issue 13, items
3, 4 and 14), through a real server with an API key and the official SDKs.

- stop sequences are capped in count and length, in both protocols;
- the prefix cache is salted per API key and per request `cache_salt`;
- the OpenAI routes take a missing `model` as the served one;
- Anthropic structured output (`output_config.format`) that cannot be honoured is refused;
- Anthropic's `message_start` already splits the prompt into cache reads and the rest.
"""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest
from serve_fixtures import MODEL_ID, make_state, serving, write_serve_model

from ninfer_core.serve.cache_salt import AUTHENTICATED_KEY, cache_salt
from ninfer_core.serve.errors import ApiError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "k-alpha"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = make_state(write_serve_model(tmp_path_factory.mktemp("edges-model")))
    with serving(state, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def submitted(server, monkeypatch) -> list:
    """The GenerationRequests the frontends hand the engine, as they come."""
    engine, seen = server.state.engine, []
    real = engine.submit

    def submit(request):
        seen.append(request)
        return real(request)

    monkeypatch.setattr(engine, "submit", submit)
    return seen


def unique_prompt() -> list[dict]:
    """A prompt no other test sent (so its cache hits are this test's own), over 3 blocks."""
    words = " ".join(["the quick brown fox"] * 12)
    return [{"role": "user", "content": f"{uuid.uuid4().hex} {words}"}]


# -- item 3: stop sequences are capped ---------------------------------------------------------


def test_stop_sequences_are_capped_in_count_and_length_in_both_protocols(oai, claude):
    ask = [{"role": "user", "content": "Hello"}]
    fine = [f"stop{i}" for i in range(63)] + ["x" * 256]  # 64 of at most 256 characters
    oai.chat.completions.create(model=MODEL_ID, messages=ask, max_tokens=2, stop=fine)
    claude.messages.create(model=MODEL_ID, messages=ask, max_tokens=2, stop_sequences=fine)
    for too_many in ([*fine, "one more"], ["x" * 257]):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=MODEL_ID, messages=ask, max_tokens=2, stop=too_many)
        assert caught.value.body["param"] == "stop"
        with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
            claude.messages.create(
                model=MODEL_ID, messages=ask, max_tokens=2, stop_sequences=too_many
            )
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences: at most 64"):
        claude.messages.create(
            model=MODEL_ID, messages=ask, max_tokens=2, stop_sequences=["s"] * 100_000
        )


# -- item 4: the prefix cache is salted ----------------------------------------------------------


def test_the_salt_mixes_the_key_and_the_requests_own():
    alpha, beta = {AUTHENTICATED_KEY: b"alpha"}, {AUTHENTICATED_KEY: b"beta"}
    assert cache_salt({}, None) is None  # no key checked, none asked for: the shared pool
    salts = [cache_salt(s, r) for s in ({}, alpha, beta) for r in (None, "u1", "u2")][1:]
    assert len(set(salts)) == len(salts) == 8 and all(salts)
    assert cache_salt(alpha, "u1") == cache_salt(dict(alpha), "u1")  # a pure function
    assert "alpha" not in cache_salt(alpha, None)  # the engine never holds the key
    for bad in ("", "x" * 1025):
        with pytest.raises(ApiError) as caught:
            cache_salt(alpha, bad)
        assert caught.value.param == "cache_salt"


def test_the_api_key_and_cache_salt_reach_the_engine_from_both_protocols(oai, claude, submitted):
    ask = [{"role": "user", "content": "Hello"}]
    oai.chat.completions.create(model=MODEL_ID, messages=ask, max_tokens=2)
    oai.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=2)
    claude.messages.create(model=MODEL_ID, messages=ask, max_tokens=2)
    oai.chat.completions.create(
        model=MODEL_ID, messages=ask, max_tokens=2, extra_body={"cache_salt": "u1"}
    )
    claude.messages.create(
        model=MODEL_ID, messages=ask, max_tokens=2, extra_body={"cache_salt": "u1"}
    )
    key = {AUTHENTICATED_KEY: KEY.encode()}
    by_key, by_key_and_user = cache_salt(key, None), cache_salt(key, "u1")
    assert [r.cache_salt for r in submitted] == [by_key] * 3 + [by_key_and_user] * 2
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=MODEL_ID, messages=ask, max_tokens=2, extra_body={"cache_salt": ""}
        )
    assert caught.value.body["param"] == "cache_salt"


def test_only_requests_with_the_same_salt_share_cached_blocks(oai, claude):
    ask = unique_prompt()

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        answer = oai.chat.completions.create(
            model=MODEL_ID, messages=ask, max_tokens=2, extra_body=extra
        )
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("alice") > 0
    assert cached("bob") == 0  # the guess about alice's prompt learns nothing
    assert cached(None) == 0
    assert cached(None) > 0
    # The same salt is the same pool in the other protocol: the prompt renders the same.
    usage = claude.messages.create(
        model=MODEL_ID, messages=ask, max_tokens=2, extra_body={"cache_salt": "alice"}
    ).usage
    assert usage.cache_read_input_tokens > 0


# -- item 14: protocol details -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_openai_routes_take_a_missing_model_as_the_served_one(server, path, body, stream):
    body = {**body, "max_tokens": 2, "stream": stream}
    answer = httpx.post(server.url + path, json=body, headers=HEADERS, timeout=30)
    assert answer.status_code == 200, answer.text
    if stream:
        assert f'"model":"{MODEL_ID}"' in answer.text
    else:
        assert answer.json()["model"] == MODEL_ID
    wrong = httpx.post(
        server.url + path, json={**body, "model": "gpt-4o"}, headers=HEADERS, timeout=30
    )
    assert wrong.status_code == 404
    assert wrong.json()["error"]["code"] == "model_not_found"


def test_anthropic_structured_output_it_cannot_honour_is_refused(claude):
    """A format other than a JSON schema, or a schema with a type that does not exist, is a
    400 naming the field (tests/test_constrained_decoding.py runs the ones it can)."""
    ask = [{"role": "user", "content": "Hi"}]
    schema = {"type": "object", "properties": {"a": {"type": "strng"}}}
    fmt = {"type": "json_schema", "schema": schema}
    for extra, param in (
        ({"output_config": {"format": fmt}}, "output_config.format"),
        ({"output_format": fmt}, "output_format"),
    ):
        with pytest.raises(anthropic.BadRequestError, match=param) as caught:
            claude.messages.create(model=MODEL_ID, messages=ask, max_tokens=2, extra_body=extra)
        assert caught.value.body["error"]["type"] == "invalid_request_error"
    # The rest of output_config (effort) asks for nothing this server would do differently.
    claude.messages.create(
        model=MODEL_ID, messages=ask, max_tokens=2, extra_body={"output_config": {"effort": "low"}}
    )


def stream_usages(claude, messages) -> tuple[dict, dict]:
    """(message_start's usage, the final usage) of a streamed message."""
    with claude.messages.stream(model=MODEL_ID, messages=messages, max_tokens=3) as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start").message.usage
    final = next(e for e in events if e.type == "message_delta").usage
    fields = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    return {f: getattr(start, f) for f in fields}, {f: getattr(final, f) for f in fields}


def with_breakpoint(messages: list[dict]) -> list[dict]:
    """The same messages with a `cache_control` breakpoint on the last one's text."""
    last = messages[-1]
    block = {"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}
    return [*messages[:-1], {"role": last["role"], "content": [block]}]


def test_anthropic_message_start_splits_cache_reads_and_writes(claude, server):
    """With a breakpoint, the full blocks a request put into the cache are its cache
    writes; the blocks it read are reads, in `message_start` already."""
    messages = with_breakpoint(unique_prompt())
    block = server.state.engine.config.block_size
    first_start, first_final = stream_usages(claude, messages)
    prompt = sum(first_final.values())
    assert first_start == first_final
    assert first_final["cache_read_input_tokens"] == 0
    assert first_final["cache_creation_input_tokens"] == prompt // block * block > 0
    again_start, again_final = stream_usages(claude, messages)
    assert again_start == again_final  # split already in message_start
    assert again_final["cache_read_input_tokens"] > 0
    assert sum(again_final.values()) == prompt
    # What was read is not written again: the full blocks are read or written, once.
    cache = again_final["cache_read_input_tokens"] + again_final["cache_creation_input_tokens"]
    assert cache == prompt // block * block


def test_anthropic_without_a_breakpoint_a_cold_prompt_is_all_input_tokens(claude):
    """As in Anthropic's API, a request with no `cache_control` writes nothing: a cold
    prompt's tokens are all `input_tokens` (they used to count as cache writes, leaving
    `input_tokens: 0`), and a warm one's are reads and input."""
    messages = unique_prompt()
    start, final = stream_usages(claude, messages)
    assert start == final and final["input_tokens"] > 0
    assert final["cache_creation_input_tokens"] == final["cache_read_input_tokens"] == 0
    _, again = stream_usages(claude, messages)
    assert again["cache_read_input_tokens"] > 0 and again["cache_creation_input_tokens"] == 0
    assert again["input_tokens"] + again["cache_read_input_tokens"] == final["input_tokens"]


def test_count_tokens_counts_a_prompt_longer_than_the_context(claude, server):
    """An agent asks how long its prompt is in order to compact it: past the context it
    gets the count (it used to get a 400), and /v1/messages still refuses to run it."""
    tools = [
        {"name": f"tool_{i}", "description": f"does thing number {i} to the input",
         "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}
        for i in range(300)
    ]  # fmt: skip
    ask = [{"role": "user", "content": "hi"}]
    count = claude.messages.count_tokens(model=MODEL_ID, messages=ask, tools=tools)
    assert count.input_tokens > server.state.max_context
    with pytest.raises(anthropic.BadRequestError, match="context"):
        claude.messages.create(model=MODEL_ID, messages=ask, tools=tools, max_tokens=2)
