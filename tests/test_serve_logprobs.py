"""`logprobs`, `min_tokens`, `return_token_ids` and `continue_final_message` through a real
server and the official `openai` SDK, against transformers as the reference.

The tiny random Qwen3 of `serve_fixtures` is written by transformers, so the reference
reads the same folder: the log probabilities a response reports must be a log-softmax of
transformers' fp32 logits for the prompt (the response's own `prompt_token_ids`) and the
tokens generated before, within 1e-4.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from checkpoints import load_reference
from serve_fixtures import MODEL_ID, make_state, openai_sdk, serving, write_serve_model

from ninfer_core.spec.config import SpecConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = 1e-4
#: Repeats, so that n-gram drafts are proposed and accepted.
REPEATING = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_serve_model(tmp_path_factory.mktemp("logprobs-model"))


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(make_state(model_dir)) as srv:
        yield srv


@pytest.fixture(scope="module")
def spec_server(model_dir):
    with serving(make_state(model_dir, spec=SpecConfig(spec="ngram", draft_tokens=3))) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai_sdk(server) as client:
        yield client


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@torch.no_grad()
def reference_logprobs(reference, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), V]: transformers' log-softmax at each generated position."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = reference(ids).logits[0].float()
    start = len(prompt_ids) - 1
    return logits[start : start + len(output_ids)].log_softmax(dim=-1)


def chat(client, **kwargs):
    body = dict(model=MODEL_ID, temperature=0, max_tokens=8, logprobs=True, top_logprobs=5)
    body.update(kwargs)
    extra = body.pop("extra_body", {})
    return client.chat.completions.create(**body, extra_body={"return_token_ids": True, **extra})


def ids_of(response) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of a response that asked `return_token_ids`."""
    choice = response.choices[0]
    prompt = response.model_extra.get("prompt_token_ids") or choice.model_extra["prompt_token_ids"]
    return prompt, choice.model_extra["token_ids"]


# -- chat ----------------------------------------------------------------------------------


def test_chat_logprobs_equal_transformers_log_softmax(client, reference):
    r = chat(client, messages=ask("Hello world!"))
    prompt, output = ids_of(r)
    content = r.choices[0].logprobs.content
    assert len(content) == len(output) == r.usage.completion_tokens == 8
    expected = reference_logprobs(reference, prompt, output)
    for i, (entry, token) in enumerate(zip(content, output, strict=True)):
        assert abs(entry.logprob - expected[i, token].item()) < TOL
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 5 and top == sorted(top, reverse=True)
        assert torch.allclose(torch.tensor(top), expected[i].topk(5).values, atol=TOL)
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6


def test_chat_logprobs_with_penalties_are_the_penalised_distribution(client):
    """Penalties come before the report, so a greedy token stays its own top entry."""
    r = chat(client, messages=ask("Hello world!"), frequency_penalty=2.0, presence_penalty=1.0)
    for entry in r.choices[0].logprobs.content:
        assert entry.top_logprobs[0].token == entry.token


def test_streamed_chat_logprobs_equal_the_whole_answer(client):
    kwargs = dict(messages=ask("Tell me a story"), max_tokens=12)
    whole = chat(client, **kwargs)
    chunks = list(chat(client, stream=True, **kwargs))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert chunks[0].model_extra["prompt_token_ids"] == ids_of(whole)[0]
    assert ids == ids_of(whole)[1]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
    for a, b in zip(streamed, whole.choices[0].logprobs.content, strict=True):
        assert abs(a.logprob - b.logprob) < TOL


def test_without_logprobs_a_choice_has_none(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=ask("hi"), max_tokens=4)
    assert r.choices[0].logprobs is None
    # Present and null, as vLLM sends them: `r.choices[0].token_ids` reads None.
    assert r.choices[0].model_extra["token_ids"] is None
    assert r.model_extra["prompt_token_ids"] is None


def test_top_logprobs_zero_gives_the_sampled_token_alone(client):
    r = chat(client, messages=ask("hi"), top_logprobs=0, max_tokens=3)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_speculative_decoding_reports_the_same_logprobs(client, spec_server, reference):
    kwargs = dict(messages=ask(REPEATING), max_tokens=24)
    plain = chat(client, **kwargs)
    with openai_sdk(spec_server) as spec_client:
        spec = chat(spec_client, **kwargs, extra_body={"return_spec_stats": True})
    assert spec.usage.model_extra["spec_stats"]["accepted_tokens"] > 0
    assert ids_of(spec) == ids_of(plain)
    prompt, output = ids_of(spec)
    expected = reference_logprobs(reference, prompt, output)
    for i, (a, b) in enumerate(
        zip(spec.choices[0].logprobs.content, plain.choices[0].logprobs.content, strict=True)
    ):
        assert a.token == b.token and abs(a.logprob - b.logprob) < TOL
        assert abs(a.logprob - expected[i, output[i]].item()) < TOL
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


# -- completions ---------------------------------------------------------------------------


def test_completion_logprobs_in_the_legacy_shape(client, reference):
    r = client.completions.create(
        model=MODEL_ID, prompt="The quick brown fox", max_tokens=8, temperature=0, logprobs=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = r.choices[0]
    lp = choice.logprobs
    prompt, output = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(output)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(output))]
    expected = reference_logprobs(reference, prompt, output)
    for i, token in enumerate(output):
        assert abs(lp.token_logprobs[i] - expected[i, token].item()) < TOL
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)


def test_streamed_completion_logprobs_equal_the_whole_answer(client):
    kwargs = dict(model=MODEL_ID, prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = client.completions.create(logprobs=2, **kwargs).choices[0]
    chunks = list(client.completions.create(logprobs=2, stream=True, **kwargs))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == whole.logprobs.tokens
    assert [o for p in pieces for o in p.text_offset] == whole.logprobs.text_offset
    got = [v for p in pieces for v in p.token_logprobs]
    assert got == pytest.approx(whole.logprobs.token_logprobs, abs=TOL)


# -- min_tokens ----------------------------------------------------------------------------


class EagerEnd:
    """A sampler that wants the end-of-turn token above all (a model that stops at once):
    it lifts that logit by 1e4 before the real sampler, so only a mask can keep it out."""

    def __init__(self, real, end: int) -> None:
        self.real, self.end = real, end

    def sample(self, logits, params, histories):
        logits = logits.clone()
        logits[:, self.end] += 1e4
        return self.real.sample(logits, params, histories)


@pytest.fixture(scope="module")
def eager_server(model_dir):
    state = make_state(model_dir)
    end = state.tokenizer.token_to_id("<|im_end|>")
    state.engine.postprocess.sampler = EagerEnd(state.engine.postprocess.sampler, end)
    with serving(state) as srv:
        yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_off_the_end_of_turn(eager_server, stream):
    with openai_sdk(eager_server) as client:
        kwargs = dict(model=MODEL_ID, messages=ask("hi"), max_tokens=20, temperature=0)
        early = client.chat.completions.create(**kwargs)
        assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
        body = dict(**kwargs, extra_body={"min_tokens": 6})
        if not stream:
            held = client.chat.completions.create(**body)
            assert held.usage.completion_tokens == 7  # 6 forced, then the end of turn
            assert held.choices[0].finish_reason == "stop"
        else:
            opts = {"include_usage": True}
            chunks = list(client.chat.completions.create(stream=True, stream_options=opts, **body))
            assert chunks[-1].usage.completion_tokens == 7


def test_min_tokens_holds_off_stop_strings(client):
    kwargs = dict(model=MODEL_ID, prompt="abc", max_tokens=12, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    assert len(free) > 2
    stop = free[1]  # a character the answer has early on
    cut = client.completions.create(stop=[stop], **kwargs)
    assert cut.usage.completion_tokens < 12
    held = client.completions.create(stop=[stop], extra_body={"min_tokens": 12}, **kwargs)
    assert held.usage.completion_tokens == 12


# -- continue_final_message and Anthropic's prefill ------------------------------------------


PREFILLED = [
    {"role": "user", "content": "Name a colour"},
    {"role": "assistant", "content": "The colour is"},
]


def test_continue_final_message_renders_the_prefill_open(client, server):
    r = client.chat.completions.create(
        model=MODEL_ID, messages=PREFILLED, max_tokens=4,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True},
    )  # fmt: skip
    prompt = r.model_extra["prompt_token_ids"]
    state = server.state
    text = state.template.render(PREFILLED, continue_final_message=True)
    assert prompt == state.tokenizer.encode(text, add_special_tokens=False)
    assert state.tokenizer.decode(prompt).endswith("The colour is")
    # Anthropic's final assistant turn is the same prefill: the same prompt
    count = httpx.post(
        server.url + "/v1/messages/count_tokens",
        json={"model": MODEL_ID, "messages": PREFILLED},
    ).json()
    assert count["input_tokens"] == len(prompt)


def test_add_generation_prompt_false_leaves_the_turn_unopened(client, server):
    r = client.chat.completions.create(
        model=MODEL_ID, messages=ask("hi"), max_tokens=2,
        extra_body={"add_generation_prompt": False, "return_token_ids": True},
    )  # fmt: skip
    state = server.state
    text = state.template.render(ask("hi"), add_generation_prompt=False)
    assert r.model_extra["prompt_token_ids"] == state.tokenizer.encode(
        text, add_special_tokens=False
    )


# -- refusals ------------------------------------------------------------------------------

CHAT = {"model": MODEL_ID, "messages": ask("hi"), "max_tokens": 4}
COMPLETION = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 4}
BAD = [
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {**CHAT, "min_tokens": -1}, "min_tokens"),
    ("chat/completions", {**CHAT, "min_tokens": 5}, "min_tokens"),
    ("completions", {**COMPLETION, "min_tokens": -3}, "min_tokens"),
    ("completions", {**COMPLETION, "logprobs": 6}, "logprobs"),
    ("completions", {**COMPLETION, "logprobs": -1}, "logprobs"),
    ("completions", {**COMPLETION, "logprobs": 2, "echo": True}, "logprobs"),
    (
        "chat/completions",
        {**CHAT, "messages": PREFILLED, "continue_final_message": True,
         "add_generation_prompt": True},
        "continue_final_message",
    ),
    ("chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p}:{x}" for p, _, x in BAD])
def test_bad_values_are_400s_naming_the_field(server, path, body, param):
    r = httpx.post(f"{server.url}/v1/{path}", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
