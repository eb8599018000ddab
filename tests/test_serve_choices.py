"""`n > 1` through a real server and the official `openai` SDK (`frontend_openai/choices.py`).

The tiny random Qwen3 of `serve_fixtures`, at most 4 sequences at once, no prefix cache, so
that the engine's prefill counter shows exactly what each request prefilled.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_fixtures import MODEL_ID, make_state, openai_sdk, serving, wait_for, write_serve_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ASK = [{"role": "user", "content": "Tell me a story about a fox."}]
NOISE = {"ignore_eos": True}  # a random model: every choice runs to max_tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_serve_model(tmp_path_factory.mktemp("serve-model"))
    state = make_state(model_dir, max_concurrency=4, prefix_cache=False)
    with serving(state) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai_sdk(server) as client:
        yield client


def test_n_choices_at_temperature_prefill_once_and_repeat_with_the_seed(client, server):
    engine = server.state.engine
    runs = []
    for _ in range(2):
        before = engine.counters.prefill_tokens
        answer = client.chat.completions.create(
            model=MODEL_ID, messages=ASK, n=4, temperature=0.8, seed=7, max_tokens=12,
            extra_body=NOISE,
        )  # fmt: skip
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert all(c.finish_reason == "length" for c in answer.choices)
        assert engine.counters.prefill_tokens - before == answer.usage.prompt_tokens
        assert answer.usage.completion_tokens == 4 * 12
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + 48
        runs.append([c.message.content for c in answer.choices])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1
    engine.check_invariants()


def test_greedy_choices_are_equal(client):
    answer = client.completions.create(
        model=MODEL_ID, prompt="def reverse(s):", n=2, temperature=0, max_tokens=10,
        extra_body=NOISE,
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].text == answer.choices[1].text != ""
    assert answer.usage.completion_tokens == 20


def test_streamed_choices_carry_every_index_and_a_finish_each(client):
    kwargs = dict(model=MODEL_ID, messages=ASK, n=3, temperature=0.9, seed=3, max_tokens=8)
    whole = client.chat.completions.create(**kwargs, extra_body=NOISE)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=NOISE
        )
    )
    texts, finishes, roles = ["", "", ""], [None, None, None], set()
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                assert finishes[choice.index] is None
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2} and finishes == ["length"] * 3
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    stream = client.completions.create(
        model=MODEL_ID, prompt="Once", n=2, max_tokens=5, stream=True, extra_body=NOISE
    )
    done = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(done) == [0, 1]


@pytest.mark.parametrize(
    "body",
    [
        {"n": 5},  # over --max-concurrency
        {"n": 0},
        {"n": 10**6},
    ],
    ids=["over-concurrency", "zero", "huge"],
)
def test_bad_n_is_a_400_naming_it(client, body):
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=4, **body)
    assert chat.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=4, **body)


def test_best_of_with_n_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_ID, prompt="hi", n=2, best_of=2, max_tokens=4)
    assert err.value.body["param"] == "best_of"


def test_cancelling_a_streamed_n_request_frees_everything(server):
    engine = server.state.engine
    body = {"model": MODEL_ID, "messages": ASK, "n": 4, "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    url = server.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        seen = set()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["delta"].get("content"):
                        seen.add(choice["index"])
            if len(seen) == 4:
                break
    wait_for(lambda: not engine.has_work)
    engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    # And the server goes on serving.
    with openai_sdk(server) as client:
        answer = client.chat.completions.create(model=MODEL_ID, messages=ASK, n=2, max_tokens=3)
    assert len(answer.choices) == 2
