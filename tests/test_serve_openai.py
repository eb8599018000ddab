"""The OpenAI frontend through a real server, driven by the official `openai` SDK.

A tiny random model answers noise, which is enough for everything but tool calls and
reasoning. For those a `ScriptedSampler` replaces the engine's sampler: for a prompt holding
one of its triggers it picks the tokens of a fixed reply instead of sampling. Everything after
the choice of token — detokenizer, stop checker, the frontend's reasoning and tool-call
parsing, the wire format, the SDK's own parsing — is the real path.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serve_fixtures import MODEL_ID, make_state, serving, write_serve_model
from text_fixtures import WEATHER_TOOL

import ninfer_plugins.frontend_openai as frontend_openai
from ninfer_core.cli.main import main as ninfer_main
from ninfer_core.plugin_host import create_host

KEY = "test-key"
#: Room for a scripted reply (the fixture's default budget is 32 tokens).
LONG = 200
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
    "</function>\n</tool_call>"
)
SCRIPTS = {
    "weather in Paris?": TOOL_CALL,
    "<tool_response>": "It is 21 degrees and clear in Paris.",
    "weather in Tokyo?": XML_CALL,
    "broken tool": "<tool_call>{not json</tool_call> sorry",
    "think first": "<think>\nThe user wants a greeting.\n</think>\n\nHello there!",
    "count please": "one two three STOP four five",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScriptedSampler:
    """Plays a fixed reply (then the end-of-turn token) for prompts with a trigger in them;
    the trigger that appears last in the prompt wins, so a tool result's turn gets its own."""

    def __init__(self, real, tokenizer, scripts: dict[str, str]) -> None:
        self.real, self.tokenizer = real, tokenizer
        end = tokenizer.token_to_id("<|im_end|>")
        self.scripts = {
            k: [*tokenizer.encode(v, add_special_tokens=False), end] for k, v in scripts.items()
        }
        self._chosen: dict[tuple[int, ...], list[int] | None] = {}

    def script_for(self, prompt_ids: tuple[int, ...]) -> list[int] | None:
        if prompt_ids not in self._chosen:
            text = self.tokenizer.decode(prompt_ids)
            found = [(text.rfind(k), k) for k in self.scripts if k in text]
            self._chosen[prompt_ids] = self.scripts[max(found)[1]] if found else None
        return self._chosen[prompt_ids]

    def sample(self, logits, params, histories):
        tokens = self.real.sample(logits, params, histories)
        for i, history in enumerate(histories):
            script = self.script_for(history.prompt_ids)
            if script is not None:
                tokens[i] = script[min(len(history.output_ids), len(script) - 1)]
        return tokens


def openai_host():
    host = create_host()
    if "openai" not in host.frontends:  # not yet an entry point of the installed package
        host = create_host(extra_plugins=[("frontend-openai", frontend_openai)])
    return host


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_serve_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    state = make_state(model_dir)
    state.engine.postprocess.sampler = ScriptedSampler(
        state.engine.postprocess.sampler, state.tokenizer, SCRIPTS
    )
    with serving(state, openai_host(), api_key=KEY) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def stream_text(client, **kwargs) -> tuple[str, str, list]:
    """(content, finish reason, chunks) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return text, next(r for r in reasons if r), chunks


# -- chat ----------------------------------------------------------------------------------


def test_streamed_text_equals_the_whole_answer_at_temperature_0(client):
    kwargs = dict(model=MODEL_ID, messages=ask("Hello world!"), temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kwargs)
    text, reason, chunks = stream_text(client, **kwargs)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content and text
    assert reason == whole.choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)


def test_usage_counts_the_rendered_prompt_and_every_generated_token(client, server):
    messages = [{"role": "system", "content": "Be brief."}, *ask("What is the weather like?")]
    r = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_completion_tokens=9, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(server.state.render(messages))
    assert r.usage.completion_tokens == 9 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9
    _text, _, chunks = stream_text(
        client,
        model=MODEL_ID,
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    # the same prompt again: its full blocks come from the prefix cache
    assert last.usage.prompt_tokens_details.cached_tokens >= 16


def test_sampling_options_reach_the_sampler(client):
    kwargs = dict(
        model=MODEL_ID,
        messages=ask("Zürich café"),
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=7,
        extra_body={"top_k": 50, "min_p": 0.01},
    )
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=ask("x"), temperature=-1)
    assert err.value.body["param"] == "temperature"


def test_stop_sequences_end_the_answer_before_them(client):
    kwargs = dict(
        model=MODEL_ID, messages=ask("count please"), stop=["STOP", "never"], max_tokens=LONG
    )
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].message.content == "one two three "
    assert r.choices[0].finish_reason == "stop"
    assert stream_text(client, **kwargs)[:2] == ("one two three ", "stop")


def test_reasoning_comes_apart_from_the_answer(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=ask("think first"), max_tokens=LONG)
    message = r.choices[0].message
    assert message.content == "Hello there!"
    assert message.reasoning_content == "\nThe user wants a greeting.\n"
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID, messages=ask("think first"), stream=True, max_tokens=LONG
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (
        message.reasoning_content
    )
    assert "".join(d.content or "" for d in deltas) == "Hello there!"


# -- tools ---------------------------------------------------------------------------------


def test_a_tool_use_round_trip(client):
    messages = ask("What is the weather in Paris?")
    r = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER_TOOL], max_tokens=LONG
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "clear"}'},
    ]
    final = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER_TOOL], max_tokens=LONG
    )
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "It is 21 degrees and clear in Paris."
    assert final.choices[0].message.tool_calls is None


def test_streamed_tool_calls_accumulate_in_the_sdk(client):
    with client.chat.completions.stream(
        model=MODEL_ID,
        messages=ask("And the weather in Tokyo?"),
        tools=[WEATHER_TOOL],
        max_tokens=LONG,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Tokyo"},
    )


def test_tool_calls_are_parsed_only_when_tools_are_offered(client):
    plain = client.chat.completions.create(
        model=MODEL_ID, messages=ask("weather in Paris?"), max_tokens=LONG
    )
    assert plain.choices[0].message.content == TOOL_CALL and not plain.choices[0].message.tool_calls
    none = client.chat.completions.create(
        model=MODEL_ID,
        messages=ask("weather in Paris?"),
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=LONG,
    )
    assert none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content == TOOL_CALL


def test_malformed_tool_output_degrades_to_text(client):
    r = client.chat.completions.create(
        model=MODEL_ID, messages=ask("a broken tool please"), tools=[WEATHER_TOOL], max_tokens=LONG
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "<tool_call>{not json</tool_call> sorry"


def test_a_named_tool_choice_must_name_a_defined_tool(client):
    choice = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL_ID, messages=ask("hi"), tools=[WEATHER_TOOL], tool_choice=choice
        )
    assert err.value.body["param"] == "tool_choice"


# -- completions, models, errors -----------------------------------------------------------


def test_completions_text_and_token_ids(client, server):
    r = client.completions.create(
        model=MODEL_ID,
        prompt="The quick brown fox",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ids = server.state.tokenizer.encode("The quick brown fox")
    assert r.object == "text_completion" and r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 6
    by_ids = client.completions.create(
        model=MODEL_ID, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == r.choices[0].text
    echoed = client.completions.create(
        model=MODEL_ID,
        prompt="The quick brown fox",
        echo=True,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert echoed.choices[0].text == "The quick brown fox" + r.choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL_ID,
            prompt="The quick brown fox",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_model_listing_and_unknown_models(client, server):
    (model,) = client.models.list().data
    assert model.id == MODEL_ID and model.owned_by == "ninfer"
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/other-model")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="other", messages=ask("hi"))
    assert err.value.body == {
        "message": err.value.body["message"],
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_max_tokens_beyond_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_ID, messages=ask("hi"), max_tokens=5000)
    assert err.value.body["code"] == "context_length_exceeded"
    assert err.value.body["param"] == "max_tokens"


def test_auth_failures_are_401_in_openai_shape(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    no_key = httpx.get(server.url + "/v1/models").json()["error"]
    for body in (err.value.body, no_key):
        assert body["type"] == "invalid_request_error" and body["code"] == "invalid_api_key"
        assert set(body) == {"message", "type", "param", "code"}
    assert "no API key" in no_key["message"]


def test_greedy_output_equals_ninfer_generate(client, model_dir, capsys):
    prompt = "Tell me about the lazy dog."
    code = ninfer_main(
        [
            "generate",
            str(model_dir),
            "--prompt",
            prompt,
            "--greedy",
            "--max-new",
            "20",
            "--dtype",
            "fp32",
        ]
    )
    assert code == 0
    expected = capsys.readouterr().out.removesuffix("\n")
    r = client.chat.completions.create(
        model=MODEL_ID, messages=ask(prompt), temperature=0, max_tokens=20
    )
    assert r.choices[0].message.content == expected
