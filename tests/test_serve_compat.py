"""What vLLM's and llama.cpp's own clients rely on, found by running their HTTP test
suites against `ninfer-serve` (tools/compat/README.md), kept here without their files.

- vLLM's `structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar`) is the
  constraint its users send; unknown fields are ignored, so without it their answers came
  back unconstrained with a 200.
- `--model-aliases`: llama.cpp ignores `model`, so its users' clients send a fixed
  placeholder (`gpt-3.5-turbo-instruct`, `text-embedding-3-small`, `gpt-4.1` in its own
  tests); a server started with those names as aliases serves them, and answers name the
  served model. Any other name is still a 404.
- The Responses API's `include: ["message.output_text.logprobs"]` / `top_logprobs` give the
  message's text every generated token's entry, the list chat completions report for the
  same request (vLLM's `responses/test_basic.py::test_logprobs` asks this way).
- A whole chat answer carries `token_ids` and `prompt_token_ids` as null when not asked
  for, as vLLM sends them: a client that reads `choice.token_ids` gets None, not an
  AttributeError from the SDK's model.
"""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest
from serve_fixtures import MODEL_ID, frontends_host, make_state, serving

import ninfer_plugins.frontend_responses as frontend_responses
from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.serve.state import ServeOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IP = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


ALIASES = ("gpt-3.5-turbo-instruct", "text-embedding-3-small", "gpt-4.1")


@pytest.fixture(scope="module")
def server():
    state = make_state(BUILTIN_ARTIFACT, max_concurrency=2)
    state.options.model_aliases = ALIASES
    with serving(state, frontends_host(("frontend-responses", frontend_responses))) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def chat(client: openai.OpenAI, structured: dict, **kwargs):
    return client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Give an example."}],
        extra_body={"structured_outputs": structured},
        **kwargs,
    )


@pytest.mark.parametrize("as_text", [False, True], ids=["object", "json-text"])
def test_structured_outputs_json_validates(client, as_text):
    schema = json.dumps(SCHEMA) if as_text else SCHEMA
    answer = chat(client, {"json": schema}, max_tokens=128, temperature=0.0)
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_structured_outputs_choice_regex_and_grammar(client):
    choices = ["Python", "Rust", "C++"]
    for seed in range(3):
        answer = chat(client, {"choice": choices}, max_tokens=8, temperature=1.0, seed=seed)
        assert answer.choices[0].message.content in choices
    answer = chat(client, {"regex": IP}, max_tokens=20, temperature=1.0, seed=1)
    assert re.fullmatch(IP, answer.choices[0].message.content)
    answer = chat(client, {"grammar": 'root ::= "a"{5,5}'}, max_tokens=8)
    assert answer.choices[0].message.content == "aaaaa"


def test_structured_outputs_on_completions(client):
    done = client.completions.create(
        model=MODEL_ID,
        prompt="Answer:",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert done.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "structured",
    [
        {"regex": {"1": "Python"}},  # vLLM's own type-error case
        {"regex": "("},
        {"json": "{not json"},
        {"json": "[" * 100_000},
        {"json": "[1, 2]"},
        {"grammar": "root ::= ("},
        {"choice": []},
        {},
        {"regex": "a+", "choice": ["a"]},
    ],
)
def test_bad_structured_outputs_are_a_400(server, structured):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "structured_outputs": structured,
        },
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_structured_outputs_beside_response_format_is_a_400(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a+"},
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "structured_outputs"


def test_token_ids_read_none_when_not_asked(client):
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    # vLLM's clients read these attributes directly (its test_return_token_ids does).
    assert answer.choices[0].token_ids is None  # type: ignore[attr-defined]
    assert answer.prompt_token_ids is None  # type: ignore[attr-defined]
    asked = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"return_token_ids": True},
    )
    assert asked.choices[0].token_ids  # type: ignore[attr-defined]
    assert asked.prompt_token_ids  # type: ignore[attr-defined]


def test_model_aliases_are_served_under_the_models_own_name(client, server):
    answer = client.chat.completions.create(
        model="gpt-3.5-turbo-instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.model == MODEL_ID
    done = client.completions.create(model="gpt-4.1", prompt="def", max_tokens=2)
    assert done.model == MODEL_ID
    vectors = client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert vectors.model == MODEL_ID
    assert client.models.retrieve("gpt-4.1").id == MODEL_ID
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as claude:
        said = claude.messages.create(
            model="gpt-4.1", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert said.model == MODEL_ID


def test_other_names_are_still_a_404(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    with claude, pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="gpt-4o", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )


def test_a_star_alias_serves_any_name():
    options = ServeOptions(model_id="m", model_aliases=("*",))
    assert options.serves("anything") and options.serves("m")
    assert not ServeOptions(model_id="m").serves("anything")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_logprobs_are_chats(client, stream):
    ask = {"input": "Say hi", "max_output_tokens": 6, "temperature": 0.0}
    chat_answer = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
    )
    want = [
        (e.token, e.logprob, len(e.top_logprobs)) for e in chat_answer.choices[0].logprobs.content
    ]
    include = ["message.output_text.logprobs"]
    response = client.responses.create(
        model=MODEL_ID, include=include, top_logprobs=5, stream=stream, **ask
    )
    if stream:  # the last event (`response.completed` or `.incomplete`) holds the response
        response = list(response)[-1].response
    got = response.output[-1].content[-1].logprobs
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in got] == want
    assert all(len(e.top_logprobs) == 5 for e in got)
    plain = client.responses.create(model=MODEL_ID, **ask)
    assert plain.output[-1].content[-1].logprobs == []
