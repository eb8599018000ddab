"""`return_spec_stats`: a request's speculative-decoding figures in both APIs' responses.

A real server on the tiny model with n-gram drafting, driven by the official `openai` and
`anthropic` SDKs. The prompt repeats itself and decoding is greedy, so the drafter finds
n-grams to propose and the target accepts some of them. Requests run one at a time, so the
change of the engine's `/metrics` counters across one request is that request's own: the
figures the response carries must equal it. Without the field, and on an engine that does
not speculate, the response must not carry the key at all (not even as null).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from serve_fixtures import MODEL_ID, make_state, serving, write_serve_model

from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.serve.state import ServeOptions, ServeState
from ninfer_core.spec.config import SpecConfig
from ninfer_core.text import ChatTemplate, GenerationDefaults

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "one two three four five one two three four five one two three four five one two"
MAX_TOKENS = 40
#: `/metrics` counter → the `spec_stats` field it must move by.
COUNTERS = {
    "ninfer_spec_decode_num_drafts_total": "rounds",
    "ninfer_spec_decode_num_draft_tokens_total": "draft_tokens",
    "ninfer_spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
#: Greedy and to the budget, so every request runs the same number of tokens.
GREEDY = {"temperature": 0, "ignore_eos": True}


def speculating_state(model_dir: Path) -> ServeState:
    """What `make_state` builds, with an engine that drafts by n-gram lookup (`make_state`
    hands its options to `EngineConfig`, and speculation is the engine's own argument)."""
    host, device = create_host(), probe_device()
    loaded = load_model(model_dir, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    spec = SpecConfig(spec="ngram", draft_tokens=3)
    engine = Engine(loaded, EngineConfig(max_context=2048), host=host, device=device, spec=spec)
    return ServeState(
        engine=engine,
        tokenizer=engine.tokenizer,
        template=ChatTemplate.from_artifact(loaded.artifact, engine.tokenizer.special_tokens),
        defaults=GenerationDefaults.from_artifact(loaded.artifact),
        options=ServeOptions(model_id=MODEL_ID, default_max_tokens=32),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_serve_model(tmp_path_factory.mktemp("spec-stats-model"))


@pytest.fixture(scope="module")
def spec_url(model_dir) -> Iterator[str]:
    with serving(speculating_state(model_dir)) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def plain_url(model_dir) -> Iterator[str]:
    with serving(make_state(model_dir)) as srv:
        yield srv.url


def spec_counters(url: str) -> dict[str, float]:
    """The spec_decode totals from `/metrics` (absent when the engine does not speculate)."""
    found = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            found[COUNTERS[name]] = float(value)
    return found


# -- the cases: each makes one request and returns (spec_stats or None, completion tokens,
# or None where the response does not count them) ------------------------------------------

Result = tuple[dict[str, Any] | None, int | None]


def extra(model: Any, key: str = "spec_stats") -> Any:
    """An extension field the SDK kept on `model`; None when the key is absent. A null sent
    for it would read as present, and fail the "omitted" checks."""
    extras = model.model_extra or {}
    if key in extras:
        assert extras[key] is not None, f"{key} sent as null"
        return extras[key]
    return None


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def chat(url: str, body: dict[str, Any]) -> Result:
    with openai_client(url) as client:
        r = client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, **body},
        )
    return extra(r.usage), r.usage.completion_tokens


def chat_stream(url: str, body: dict[str, Any], *, include_usage: bool) -> Result:
    """With a usage chunk the figures ride in its usage; without one, on the finish chunk.
    Nowhere else either way."""
    with openai_client(url) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL_ID,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": include_usage},
                extra_body={"ignore_eos": True, **body},
            )
        )
    return from_chunks(chunks, include_usage)


def from_chunks(chunks: list[Any], include_usage: bool) -> Result:
    *body, last = chunks
    if include_usage:
        assert last.choices == [] and last.usage is not None
        assert all(extra(c) is None for c in chunks)
        return extra(last.usage), last.usage.completion_tokens
    finish = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason]
    assert finish == [len(chunks) - 1] and last.usage is None
    assert all(extra(c) is None for c in body)
    return extra(last), None


def completions(url: str, body: dict[str, Any]) -> Result:
    with openai_client(url) as client:
        r = client.completions.create(
            model=MODEL_ID,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, **body},
        )
    return extra(r.usage), r.usage.completion_tokens


def completions_stream(url: str, body: dict[str, Any], *, include_usage: bool) -> Result:
    with openai_client(url) as client:
        chunks = list(
            client.completions.create(
                model=MODEL_ID,
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": include_usage},
                extra_body={"ignore_eos": True, **body},
            )
        )
    return from_chunks(chunks, include_usage)


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def messages(url: str, body: dict[str, Any]) -> Result:
    with anthropic_client(url) as client:
        m = client.messages.create(
            model=MODEL_ID,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body={"temperature": 0, **body},
        )
    return extra(m.usage), m.usage.output_tokens


def messages_stream(url: str, body: dict[str, Any]) -> Result:
    """The figures ride in `message_delta`'s usage, the final one; `message_start`'s usage
    (sent before any token) never has them."""
    with anthropic_client(url) as client:
        events = list(
            client.messages.create(
                model=MODEL_ID,
                max_tokens=MAX_TOKENS,
                messages=[{"role": "user", "content": PROMPT}],
                stream=True,
                extra_body={"temperature": 0, **body},
            )
        )
    (start,) = [e for e in events if e.type == "message_start"]
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert extra(start.message.usage) is None
    return extra(delta.usage), delta.usage.output_tokens


CASES: dict[str, Callable[[str, dict[str, Any]], Result]] = {
    "chat": chat,
    "chat-stream-usage": lambda url, body: chat_stream(url, body, include_usage=True),
    "chat-stream": lambda url, body: chat_stream(url, body, include_usage=False),
    "completions": completions,
    "completions-stream-usage": lambda url, body: completions_stream(url, body, include_usage=True),
    "completions-stream": lambda url, body: completions_stream(url, body, include_usage=False),
    "messages": messages,
    "messages-stream": messages_stream,
}
ASKED = {"return_spec_stats": True}

each_case = pytest.mark.parametrize("case", CASES)


# -- tests ---------------------------------------------------------------------------------


@each_case
def test_asked_the_figures_are_the_requests_own(spec_url, case):
    before = spec_counters(spec_url)
    stats, tokens = CASES[case](spec_url, ASKED)
    after = spec_counters(spec_url)
    assert stats is not None
    assert set(stats) == {"rounds", *COUNTERS.values(), "acceptance_rate", "tokens_per_round"}
    # One request at a time: the engine's totals moved by exactly this request's rounds.
    assert {k: after[k] - before[k] for k in after} == {k: stats[k] for k in COUNTERS.values()}
    rounds, drafted, accepted = stats["rounds"], stats["draft_tokens"], stats["accepted_tokens"]
    assert rounds >= 1 and 0 < accepted <= drafted <= 3 * rounds  # a repeating prompt: accepted
    assert stats["acceptance_rate"] == round(accepted / drafted, 4)
    assert stats["tokens_per_round"] == round(1 + accepted / rounds, 4)
    # A round yields its accepted drafts plus one token of the target's.
    assert tokens is None or tokens >= rounds + accepted


@each_case
def test_not_asked_there_is_no_spec_stats_key(spec_url, case):
    stats, _ = CASES[case](spec_url, {})
    assert stats is None


@each_case
def test_an_engine_that_does_not_speculate_omits_them_even_when_asked(plain_url, case):
    stats, tokens = CASES[case](plain_url, ASKED)
    assert stats is None and tokens != 0


def test_default_responses_keep_their_exact_shape(spec_url):
    """The raw JSON, not the SDK's view: no `spec_stats` key, null or otherwise."""
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, **GREEDY}
    r = httpx.post(spec_url + "/v1/completions", json=body, timeout=30).json()
    assert set(r["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens",
                               "prompt_tokens_details"}  # fmt: skip
    assert "spec_stats" not in r
    m = httpx.post(
        spec_url + "/v1/messages",
        json={"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    ).json()
    assert set(m["usage"]) == {"input_tokens", "cache_creation_input_tokens",
                               "cache_read_input_tokens", "output_tokens"}  # fmt: skip


@pytest.mark.parametrize("value", ["maybe", {"on": True}, [True]])
def test_a_non_boolean_is_a_400_in_each_protocols_shape(spec_url, value):
    bad = {"return_spec_stats": value}
    with pytest.raises(openai.BadRequestError) as chat_error:
        chat(spec_url, bad)
    with pytest.raises(openai.BadRequestError) as completion_error:
        completions(spec_url, bad)
    for exc in (chat_error.value, completion_error.value):
        assert exc.status_code == 400 and "return_spec_stats" in str(exc.body)
        assert exc.body["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as message_error:
        messages(spec_url, bad)
    body = message_error.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "return_spec_stats" in body["error"]["message"]
