"""A forced `tool_choice` through both frontends and their official SDKs, whole and streamed.

OpenAI's "required" / a named function and Anthropic's `any` / `tool` prefill the answer with
the opening of the model's call (`ninfer_core.text.tool_choice`). The scripted model here
writes only what follows that opening — as a model must once the prompt ends inside
`<tool_call>` — so a proper tool call in the answer shows that the prompt ended with the
opening and that the parser read it as part of the output.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch
from serve_fixtures import MODEL_ID, make_state, serving, write_serve_model
from text_fixtures import QWEN3_STYLE_TEMPLATE, WEATHER_TOOL

from ninfer_core.text import ChatTemplate
from ninfer_core.text.tool_choice import ForcedCall, call_format, call_opening, with_opening

CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
WEATHER = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
#: What the model writes after each opening.
AFTER_ANY = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
AFTER_NAMED = ' {"city": "Oslo"}}\n</tool_call>'
GENERATION_PROMPT = "<|im_start|>assistant\n"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScriptedSampler:
    """Emits `ids` then end-of-turn; records each prompt it was asked to continue."""

    def __init__(self, ids: list[int], end: int) -> None:
        self.ids, self.end = ids, end
        self.prompts: list[tuple[int, ...]] = []

    def sample(self, logits, params, histories):
        out = []
        for history in histories:
            n = len(history.output_ids)
            if n == 0:
                self.prompts.append(history.prompt_ids)
            out.append(self.ids[n] if n < len(self.ids) else self.end)
        return torch.tensor(out, dtype=torch.long)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = make_state(write_serve_model(tmp_path_factory.mktemp("tool-choice-model")))
    with serving(state) as srv:
        yield srv


@pytest.fixture
def script(server, monkeypatch):
    """`script(text)`: the model's next answers are `text`; returns a function giving the
    last prompt as text."""

    def use(text: str):
        tok = server.state.tokenizer
        sampler = ScriptedSampler(
            tok.encode(text, add_special_tokens=False), tok.token_to_id("<|im_end|>")
        )
        monkeypatch.setattr(server.state.engine.postprocess, "sampler", sampler)
        return lambda: tok.decode(sampler.prompts[-1])

    return use


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
        yield client


# -- OpenAI ----------------------------------------------------------------------------------


def openai_answers(client, **kwargs) -> list[tuple[list[tuple[str, dict]], str | None, str]]:
    """[(calls as (name, arguments), content, finish reason)] of the whole and the streamed
    answer."""
    kwargs = dict(model=MODEL_ID, messages=ASK, max_tokens=100, **kwargs)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []
    ]
    answers = [(calls, whole.message.content, whole.finish_reason)]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    content = "".join(c.choices[0].delta.content or "" for c in chunks) or None
    reason = next(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)
    streamed = [(t.function.name, json.loads(t.function.arguments)) for t in deltas]
    assert [t.index for t in deltas] == list(range(len(deltas)))
    return [*answers, (streamed, content, reason)]


def test_openai_required_forces_a_call(oai, script):
    prompt = script(AFTER_ANY)
    answers = openai_answers(oai, tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice="required")
    assert prompt().endswith(GENERATION_PROMPT + "<tool_call>\n")
    for calls, content, reason in answers:
        assert calls == [("get_weather", {"city": "Paris"})]
        assert content is None and reason == "tool_calls"


def test_openai_named_function_forces_that_call(oai, script):
    prompt = script(AFTER_NAMED)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answers = openai_answers(oai, tools=[CLOCK_TOOL, WEATHER_TOOL], tool_choice=choice)
    assert prompt().endswith('<tool_call>\n{"name": "get_weather", "arguments":')
    assert "get_time" not in prompt()  # a named choice shows only that tool
    for calls, content, reason in answers:
        assert calls == [("get_weather", {"city": "Oslo"})]
        assert content is None and reason == "tool_calls"


def test_openai_auto_prefills_nothing(oai, script):
    prompt = script("It is sunny.")
    [(calls, content, reason), _] = openai_answers(oai, tools=[WEATHER_TOOL], tool_choice="auto")
    assert prompt().endswith(GENERATION_PROMPT)
    assert (calls, content, reason) == ([], "It is sunny.", "stop")


def test_openai_usage_counts_the_opening_as_prompt(oai, server, script):
    script(AFTER_ANY)
    tools = [WEATHER_TOOL, CLOCK_TOOL]
    kwargs = dict(model=MODEL_ID, messages=ASK, max_tokens=100, tools=tools)
    auto = oai.chat.completions.create(**kwargs).usage
    forced = oai.chat.completions.create(tool_choice="required", **kwargs).usage
    opening = server.state.tokenizer.encode("<tool_call>\n", add_special_tokens=False)
    assert forced.prompt_tokens == auto.prompt_tokens + len(opening)


UNOFFERED = '{"name": "read_file", "arguments": {"path": "/etc/passwd"}}\n</tool_call>'


def test_openai_required_with_one_tool_names_it(oai, script):
    """With one tool, "required" is a call to that tool: its name is prefilled too."""
    prompt = script(AFTER_NAMED)
    answers = openai_answers(oai, tools=[WEATHER_TOOL], tool_choice="required")
    assert prompt().endswith('<tool_call>\n{"name": "get_weather", "arguments":')
    for calls, content, reason in answers:
        assert calls == [("get_weather", {"city": "Oslo"})]
        assert content is None and reason == "tool_calls"


# Under a forced choice such a call cannot be written: the grammar allows only the offered
# tools (tests/test_constrained_decoding.py), and this scripted model would bypass it.
@pytest.mark.parametrize("choice", ["auto"])
def test_openai_a_call_to_a_tool_not_offered_stays_text(oai, script, choice):
    script(("<tool_call>\n" if choice == "auto" else "") + UNOFFERED)
    for calls, content, reason in openai_answers(
        oai, tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice=choice
    ):
        assert calls == [] and reason == "stop"
        assert '"read_file"' in content


# -- Anthropic -------------------------------------------------------------------------------


def anthropic_answers(client, **kwargs) -> list:
    kwargs = dict(model=MODEL_ID, messages=ASK, max_tokens=100, **kwargs)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    return [whole, streamed]


def blocks(message) -> list[tuple]:
    return [
        (b.type, b.name, b.input) if b.type == "tool_use" else (b.type,) for b in message.content
    ]


def test_anthropic_any_forces_a_call(claude, script):
    prompt = script(AFTER_ANY)
    for message in anthropic_answers(claude, tools=[CLOCK, WEATHER], tool_choice={"type": "any"}):
        assert message.stop_reason == "tool_use"
        assert blocks(message) == [("tool_use", "get_weather", {"city": "Paris"})]
    assert prompt().endswith(GENERATION_PROMPT + "<tool_call>\n")


def test_anthropic_named_tool_forces_that_call(claude, script):
    prompt = script(AFTER_NAMED)
    choice = {"type": "tool", "name": "get_weather"}
    for message in anthropic_answers(claude, tools=[CLOCK, WEATHER], tool_choice=choice):
        assert message.stop_reason == "tool_use"
        assert blocks(message) == [("tool_use", "get_weather", {"city": "Oslo"})]
        assert message.content[0].id.startswith("toolu_")
    assert prompt().endswith('<tool_call>\n{"name": "get_weather", "arguments":')


def test_anthropic_any_with_one_tool_names_it(claude, script):
    prompt = script(AFTER_NAMED)
    for message in anthropic_answers(claude, tools=[WEATHER], tool_choice={"type": "any"}):
        assert message.stop_reason == "tool_use"
        assert blocks(message) == [("tool_use", "get_weather", {"city": "Oslo"})]
    assert prompt().endswith('<tool_call>\n{"name": "get_weather", "arguments":')


@pytest.mark.parametrize("choice", ["auto"])  # forced: see the OpenAI test above
def test_anthropic_a_call_to_a_tool_not_offered_stays_text(claude, script, choice):
    script(("<tool_call>\n" if choice == "auto" else "") + UNOFFERED)
    for message in anthropic_answers(claude, tools=[CLOCK, WEATHER], tool_choice={"type": choice}):
        assert message.stop_reason == "end_turn"
        assert blocks(message) == [("text",)]
        assert '"read_file"' in message.content[0].text


def test_anthropic_count_tokens_includes_the_opening(claude, script):
    script(AFTER_NAMED)  # one tool offered: `any` is a call to it, its name prefilled
    kwargs = dict(model=MODEL_ID, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"})
    counted = claude.messages.count_tokens(**kwargs).input_tokens
    usage = claude.messages.create(max_tokens=100, **kwargs).usage
    parts = (usage.input_tokens, usage.cache_creation_input_tokens, usage.cache_read_input_tokens)
    assert counted == sum(parts)


# -- the shared prefill ----------------------------------------------------------------------

XML_TEMPLATE = "{{ messages[0].content }}<tool_call>\n<function=NAME>\n</function></tool_call>"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def test_the_opening_follows_the_templates_call_form():
    qwen, xml, plain = (
        ChatTemplate(t) for t in (QWEN3_STYLE_TEMPLATE, XML_TEMPLATE, PLAIN_TEMPLATE)
    )
    assert (call_format(qwen), call_format(xml), call_format(plain)) == ("json", "xml", None)
    named = ForcedCall('say "hi"')
    assert call_opening(qwen, named) == '<tool_call>\n{"name": "say \\"hi\\"", "arguments":'
    assert call_opening(xml, named) == '<tool_call>\n<function=say "hi">\n'
    assert call_opening(qwen, ForcedCall()) == call_opening(xml, ForcedCall()) == "<tool_call>\n"
    # No <tool_call> in the template: nothing to prefill; the choice is only asked for.
    assert call_opening(plain, ForcedCall()) == call_opening(None, ForcedCall()) == ""
    assert call_opening(qwen, None) == ""


def test_an_open_think_block_is_closed_before_the_call(server):
    tok = server.state.tokenizer
    opened = tok.encode(GENERATION_PROMPT + "<think>\n", add_special_tokens=False)
    closed = tok.encode(GENERATION_PROMPT + "<think>\n\n</think>\n\n", add_special_tokens=False)
    assert tok.decode(with_opening(tok, opened, "<tool_call>\n")).endswith(
        "<think>\n</think>\n\n<tool_call>\n"
    )
    assert tok.decode(with_opening(tok, closed, "<tool_call>\n")).endswith(
        "<think>\n\n</think>\n\n<tool_call>\n"
    )
    assert with_opening(tok, closed, "") == closed
