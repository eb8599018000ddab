"""`n` choices through the one answer loop (`frontend_openai/choices.py`): every choice gets
what a single answer gets, and the request what a single request gets.

Two halves. A real server on the tiny random Qwen3 of `serve_fixtures`, read as raw JSON:
greedy choices of `n = 2` must each be, chunk for chunk, the `n = 1` answer (the seed rule
makes choice 0 the single answer, and greedy makes every choice it); seeded choices must
stream exactly what the whole answer holds, with log probabilities, token ids and usage
summed over the choices' own token ids. And, since the engine refuses `--spec` with
`n` > 1, the loop driven directly by hand-made engine events carrying speculative rounds:
the request's `spec_stats` are the choices' rounds summed (written out by hand here), once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from serve_fixtures import MODEL_ID, make_state, serving, write_serve_model

from ninfer_core.engine.request import FinishEvent, GenerationEvent, TokenEvent, Usage
from ninfer_core.spec.stats import SpecUsage
from ninfer_plugins.frontend_openai import wire
from ninfer_plugins.frontend_openai.chat import ChatChoices, Tokens
from ninfer_plugins.frontend_openai.choices import Choices, Head, gather, reply, stream
from ninfer_plugins.frontend_openai.common import StreamExtras
from ninfer_plugins.frontend_openai.completions import ChoiceExtras, CompletionChoices
from ninfer_plugins.frontend_openai.output import ChatOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ASK = [{"role": "user", "content": "Tell me a story about a fox."}]
PROMPT = "Once upon a time"
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    model_dir = write_serve_model(tmp_path_factory.mktemp("n-choices-model"))
    with serving(make_state(model_dir, max_concurrency=4)) as srv:
        yield srv.url


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    """The whole answer as JSON, or a stream's chunks as a list of JSON objects."""
    r = httpx.post(url + path, json={"model": MODEL_ID, **body}, timeout=60)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def anonymous(obj: dict[str, Any]) -> dict[str, Any]:
    """A chunk or answer without what differs between any two requests."""
    return {k: v for k, v in obj.items() if k not in ("id", "created")}


def of_choice(chunks: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """The chunks that carry choice `index` (each chunk carries one choice)."""
    out = []
    for chunk in chunks:
        assert len(chunk["choices"]) <= 1
        if chunk["choices"] and chunk["choices"][0]["index"] == index:
            out.append(anonymous(chunk))
    return out


def usage_chunk(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The stream's last chunk, which must be its only one without choices."""
    assert [c for c in chunks if not c["choices"]] == [chunks[-1]]
    return chunks[-1]["usage"]


# -- n = 2 greedy is twice the n = 1 answer ------------------------------------------------

GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 8, "return_token_ids": True}
ENDPOINTS = [
    ("/v1/chat/completions", {"messages": ASK}),
    ("/v1/completions", {"prompt": PROMPT, "echo": True}),
]


@pytest.mark.parametrize(("path", "ask"), ENDPOINTS, ids=["chat", "completions"])
def test_each_greedy_choice_streams_the_single_answer(url, path, ask):
    body = {**ask, **GREEDY, **STREAMED}
    one = post(url, path, body)
    two = post(url, path, {**body, "n": 2})
    single = of_choice(one, 0)
    assert of_choice(two, 0) == single
    # Choice 1: the same chunks under its own index; the prompt's ids go out once per
    # request in chat (its first chunk), on each choice's first chunk in completions.
    renamed = [json.loads(json.dumps(c).replace('"index": 0', '"index": 1')) for c in single]
    if path == "/v1/chat/completions":
        del renamed[0]["prompt_token_ids"]
    assert of_choice(two, 1) == renamed
    once, twice = usage_chunk(one), usage_chunk(two)
    assert twice["prompt_tokens"] == once["prompt_tokens"]
    assert twice["completion_tokens"] == 2 * once["completion_tokens"] == 2 * 8
    assert twice["total_tokens"] == twice["prompt_tokens"] + 16


@pytest.mark.parametrize(("path", "ask"), ENDPOINTS, ids=["chat", "completions"])
def test_each_greedy_choice_is_the_single_whole_answer(url, path, ask):
    one = post(url, path, {**ask, **GREEDY})
    two = post(url, path, {**ask, **GREEDY, "n": 2})
    assert [c["index"] for c in two["choices"]] == [0, 1]
    for choice in two["choices"]:
        assert {**choice, "index": 0} == one["choices"][0]
    assert two["usage"]["completion_tokens"] == 2 * one["usage"]["completion_tokens"] == 16
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    rest = {k: v for k, v in anonymous(two).items() if k not in ("choices", "usage")}
    assert rest == {k: v for k, v in anonymous(one).items() if k not in ("choices", "usage")}


# -- seeded choices: the stream holds the whole answer -------------------------------------


def uncached(spent: dict[str, Any]) -> dict[str, Any]:
    """Usage without its cached-token count: the later of the two requests compared finds
    the earlier one's prompt in the prefix cache."""
    return {k: v for k, v in spent.items() if k != "prompt_tokens_details"}


def rounded(value: Any) -> Any:
    """`value` with every float rounded to 4 decimals: the two requests compared run the
    prompt once from scratch and once from the prefix cache, whose logits may differ in
    the last float bits; tokens, bytes and ids must still be equal."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


SEEDED = {"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 10, "return_token_ids": True}


def test_chat_choices_stream_their_whole_answer_with_logprobs_and_ids(url):
    body = {"messages": ASK, **SEEDED, "logprobs": True, "top_logprobs": 2}
    whole = post(url, "/v1/chat/completions", body)
    chunks = post(
        url,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert "prompt_token_ids" in chunks[0] and chunks[0]["choices"][0]["index"] == 0
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed_tokens = 0
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in of_choice(chunks, choice["index"])]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        text = "".join(c["delta"].get("content") or "" for c in mine)
        ids = [t for c in mine for t in c.get("token_ids") or []]
        lps = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert text == choice["message"]["content"]
        assert ids == choice["token_ids"]
        assert rounded(lps) == rounded(choice["logprobs"]["content"])
        assert len(lps) == len(ids) and all(len(e["top_logprobs"]) == 2 for e in lps)
        streamed_tokens += len(ids)
    spent = usage_chunk(chunks)
    assert uncached(spent) == uncached(whole["usage"])
    assert spent["completion_tokens"] == streamed_tokens
    assert spent["completion_tokens"] == sum(len(c["token_ids"]) for c in whole["choices"])
    assert spent["prompt_tokens"] == len(whole["prompt_token_ids"])
    assert spent["total_tokens"] == spent["prompt_tokens"] + streamed_tokens


def test_completion_choices_stream_their_whole_answer_with_logprobs_and_ids(url):
    body = {"prompt": PROMPT, **SEEDED, "logprobs": 2, "echo": False}
    whole = post(url, "/v1/completions", body)
    chunks = post(url, "/v1/completions", {**body, **STREAMED})
    prompt_ids = whole["choices"][0]["prompt_token_ids"]
    streamed_tokens = 0
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        mine = [c["choices"][0] for c in of_choice(chunks, choice["index"])]
        assert mine[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
        ids = [t for c in mine for t in c.get("token_ids") or []]
        lps = {key: [] for key in choice["logprobs"]}
        for c in mine:
            for key in lps:
                lps[key] += c["logprobs"][key] if c["logprobs"] else []
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert ids == choice["token_ids"]
        assert rounded(lps) == rounded(choice["logprobs"])
        # Offsets count each choice's own text from its start.
        tokens = choice["logprobs"]["tokens"]
        assert len(tokens) == len(ids)
        assert choice["logprobs"]["text_offset"] == [
            sum(len(t) for t in tokens[:k]) for k in range(len(tokens))
        ]
        streamed_tokens += len(ids)
    spent = usage_chunk(chunks)
    assert uncached(spent) == uncached(whole["usage"])
    assert spent["completion_tokens"] == streamed_tokens
    assert spent["total_tokens"] == spent["prompt_tokens"] + streamed_tokens
    assert spent["prompt_tokens"] == len(prompt_ids)


# -- the request's speculative rounds, summed over its choices ------------------------------

#: Each choice's rounds: (rounds, drafted, accepted).
ROUNDS = {0: (3, 9, 6), 1: (2, 6, 1), 2: (0, 0, 0)}
#: Their sum in `spec_stats`' shape, worked out by hand: 7 / 15 and 1 + 7 / 5.
SUMMED = {
    "rounds": 5,
    "draft_tokens": 15,
    "accepted_tokens": 7,
    "acceptance_rate": 0.4667,
    "tokens_per_round": 2.4,
}
PROMPT_TOKENS, CACHED = 7, 3


def events(n: int, order: list[int]) -> list[GenerationEvent]:
    """Two tokens per choice ("a", "b"), finishing in `order`; interleaved as a batch."""
    out: list[GenerationEvent] = []
    for step, text in enumerate("ab"):
        out += [TokenEvent("r", text, (10 * i + step,), index=i) for i in range(n)]
    for i in order:
        spent = Usage(PROMPT_TOKENS, 2, CACHED, SpecUsage(*ROUNDS[i]))
        out.append(FinishEvent("r", "length", spent, index=i))
    return out


async def feed(items: list[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
    for item in items:
        yield item


def chat_choices(n: int) -> ChatChoices:
    return ChatChoices(Head("id", 0, "m"), n, ChatOutput(None, thinking_open=False), Tokens())


def completion_choices(n: int) -> CompletionChoices:
    return CompletionChoices(Head("id", 0, "m"), n, "", ChoiceExtras())


def streamed(choices: Choices, items: list[GenerationEvent], include_usage: bool) -> list[dict]:
    async def run() -> list[str]:
        source = feed(items)
        extras = StreamExtras(include_usage=include_usage, spec_stats=True)
        return [c async for c in stream(await anext(source), source, choices, extras)]

    return [json.loads(c) for c in asyncio.run(run())]


def spec_json(rounds: tuple[int, int, int]) -> dict[str, float]:
    """`spec_stats` of one choice's (rounds, drafted, accepted), by the documented formulas."""
    r, d, a = rounds
    rates = {"acceptance_rate": round(a / d, 4), "tokens_per_round": round(1 + a / r, 4)}
    return {"rounds": r, "draft_tokens": d, "accepted_tokens": a, **rates}


class Connected:
    """A request whose client never leaves (`until_disconnect` reads it)."""

    async def receive(self) -> dict[str, str]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}


def whole(choices: Choices, items: list[GenerationEvent], data: wire.SamplingFields) -> Any:
    response = asyncio.run(reply(Connected(), data, feed(items), choices))  # type: ignore[arg-type]
    return json.loads(wire.encode(response.content))


MAKERS = {"chat": chat_choices, "completions": completion_choices}


@pytest.mark.parametrize("endpoint", MAKERS)
@pytest.mark.parametrize("n", [1, 3])
def test_stream_sends_the_requests_spec_stats_once_on_its_last_finish(endpoint, n):
    order = [2, 0, 1] if n == 3 else [0]
    chunks = streamed(MAKERS[endpoint](n), events(n, order), include_usage=False)
    finishes = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["index"] for c in finishes] == order
    assert chunks[-1] is finishes[-1]
    with_stats = [c for c in chunks if "spec_stats" in c]
    assert with_stats == [finishes[-1]]
    assert finishes[-1]["spec_stats"] == (SUMMED if n > 1 else spec_json(ROUNDS[0]))


@pytest.mark.parametrize("endpoint", MAKERS)
def test_stream_usage_chunk_carries_the_summed_usage_and_spec_stats(endpoint):
    chunks = streamed(MAKERS[endpoint](3), events(3, [1, 2, 0]), include_usage=True)
    assert [c for c in chunks if "spec_stats" in c] == []
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 6,
        "total_tokens": PROMPT_TOKENS + 6,
        "prompt_tokens_details": {"cached_tokens": CACHED},
        "spec_stats": SUMMED,
    }
    assert all("spec_stats" not in (c.get("usage") or {}) for c in chunks[:-1])


@pytest.mark.parametrize("endpoint", MAKERS)
@pytest.mark.parametrize("asked", [True, False])
def test_whole_answer_usage_sums_choices_and_their_spec_stats(endpoint, asked):
    data = (
        wire.ChatCompletionRequest(messages=[], n=3, return_spec_stats=asked)
        if endpoint == "chat"
        else wire.CompletionRequest(prompt="x", n=3, return_spec_stats=asked)
    )
    answer = whole(MAKERS[endpoint](3), events(3, [2, 1, 0]), data)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    texts = [
        c["message"]["content"] if endpoint == "chat" else c["text"] for c in answer["choices"]
    ]
    assert texts == ["ab"] * 3
    expected = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 6,
        "total_tokens": PROMPT_TOKENS + 6,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }
    assert answer["usage"] == ({**expected, "spec_stats": SUMMED} if asked else expected)


def test_a_stream_of_events_that_ends_early_is_an_error():
    items = events(2, [0])  # choice 1 never finishes
    with pytest.raises(RuntimeError, match="before every choice finished"):
        asyncio.run(gather(feed(items), chat_choices(2)))
