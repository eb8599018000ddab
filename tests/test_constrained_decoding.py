"""Constrained decoding end to end: the built-in model behind the real server, driven by the
official `openai` and `anthropic` SDKs. Every answer under a schema must validate
(`jsonschema`), whole and streamed, greedy and sampled; a forced tool call must parse and
name an offered tool with arguments that match its schema; speculative decoding must not
change a greedy answer; a schema that cannot be compiled is a 400 in each protocol's shape;
a request without a constraint is decoded exactly as before.
"""

from __future__ import annotations

import json
import time

import anthropic
import jsonschema
import openai
import pytest
import torch
from constrained_fixtures import (
    ASK,
    ASK_TOOL,
    CLAUDE_TOOLS,
    MAX_TOKENS,
    OAI_TOOLS,
    SCHEMAS,
    TOOLS,
    chat_answer,
    chat_json,
    claude_json,
    claude_message,
    completion_text,
)
from serve_fixtures import MODEL_ID, frontends_host, make_state, openai_sdk, serving

import ninfer_plugins.frontend_responses as frontend_responses
from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.sampling import SamplingParams
from ninfer_core.sampling.grammar import Constraint
from ninfer_core.spec.config import SpecConfig
from ninfer_core.text.tool_choice import ForcedCall, call_grammar

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server():
    host = frontends_host(("frontend-responses", frontend_responses))
    with serving(make_state(BUILTIN_ARTIFACT, max_concurrency=4), host) as srv:
        yield srv


@pytest.fixture(scope="module")
def spec_server():
    with serving(make_state(BUILTIN_ARTIFACT, spec=SpecConfig(spec="ngram"))) as srv:
        yield srv


def claude_client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_openai_json_schema_answers_validate(server, name, stream, temperature):
    with openai_sdk(server) as client:
        for seed in range(2 if temperature else 1):
            text, reason = chat_json(
                client, SCHEMAS[name], stream=stream, temperature=temperature, seed=seed
            )
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_anthropic_output_format_answers_validate(server, name, stream, temperature):
    with claude_client(server) as client:
        text, reason = claude_json(client, SCHEMAS[name], stream=stream, temperature=temperature)
    assert reason == "end_turn", text
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_mode_gives_an_object(server):
    """Any object: nothing bounds its strings, so a small model may fill its budget inside
    one; an answer that ends by itself is always an object."""
    ended = 0
    with openai_sdk(server) as client:
        for seed in range(8):
            choice = client.chat.completions.create(
                model=MODEL_ID,
                messages=[{"role": "user", "content": "Call the tool."}],
                max_tokens=64,
                temperature=1.0,
                seed=seed,
                response_format={"type": "json_object"},
            ).choices[0]
            assert choice.message.content.startswith("{")
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content), dict)
                ended += 1
    assert ended


def test_completions_take_llama_cpp_json_schema_and_gbnf(server):
    schema = SCHEMAS["numbers with bounds"]
    with openai_sdk(server) as client:
        text = completion_text(client, "A record:", extra_body={"json_schema": schema})
        jsonschema.validate(json.loads(text), schema)
        gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
        for seed in range(4):
            text = completion_text(
                client,
                "Answer:",
                max_tokens=16,
                temperature=1.0,
                seed=seed,
                extra_body={"grammar": gbnf},
            )
            assert text in ("yes", "no") or (text[:6] == "maybe " and text[6:].isdigit()), text


def test_responses_text_format_validates(server):
    schema = SCHEMAS["nested objects"]
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    with openai_sdk(server) as client:
        answer = client.responses.create(
            model=MODEL_ID,
            input="Describe a user.",
            max_output_tokens=MAX_TOKENS,
            text={"format": fmt},
        )
    jsonschema.validate(json.loads(answer.output_text), schema)
    assert answer.text.format.type == "json_schema"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_openai_forced_tool_calls_parse_and_match(server, stream, choice):
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    with openai_sdk(server) as client:
        for seed in range(3):
            _, calls, reason = chat_answer(
                client,
                stream=stream,
                messages=ASK_TOOL,
                tools=OAI_TOOLS,
                tool_choice=tool_choice,
                temperature=1.0,
                seed=seed,
            )
            assert reason == "tool_calls" and len(calls) == 1, calls
            name, arguments = calls[0]
            assert name in TOOLS and (choice == "required" or name == "get_time")
            jsonschema.validate(json.loads(arguments), TOOLS[name]["parameters"])


#: The weather tool as Pydantic writes its schema: the options in `$defs`, by reference.
PYDANTIC_WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "$defs": {
            "WeatherOptions": {
                "type": "object",
                "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["unit"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "options": {"$ref": "#/$defs/WeatherOptions"},
        },
        "required": ["city", "options"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_take_schemas_with_defs_and_refs(server, choice):
    """`$defs`/`$ref` (Pydantic, the agent SDKs) under `tool_choice` required or named:
    the call's arguments match the schema, references resolved (a 400 before)."""
    tools = [{"type": "function", "function": PYDANTIC_WEATHER},
             {"type": "function", "function": TOOLS["get_time"]}]  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    with openai_sdk(server) as client:
        for seed in range(2):
            _, calls, reason = chat_answer(
                client, stream=False, messages=ASK_TOOL, tools=tools, temperature=1.0,
                seed=seed, tool_choice="required" if choice == "required" else named,
            )  # fmt: skip
            assert reason == "tool_calls" and len(calls) == 1, calls
            name, arguments = calls[0]
            schema = PYDANTIC_WEATHER["parameters"] if name == "get_weather" else None
            if schema is not None:
                jsonschema.validate(json.loads(arguments), schema)
            assert choice == "required" or name == "get_weather"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use_parses_and_matches(server, stream, choice):
    with claude_client(server) as client:
        for _ in range(3):
            message = claude_message(
                client,
                stream=stream,
                messages=ASK_TOOL,
                tools=CLAUDE_TOOLS,
                tool_choice=choice,
                extra_body={"temperature": 1.0},
            )
            uses = [b for b in message.content if b.type == "tool_use"]
            assert message.stop_reason == "tool_use" and len(uses) == 1, message.content
            assert uses[0].name in TOOLS and choice.get("name", uses[0].name) == uses[0].name
            jsonschema.validate(uses[0].input, TOOLS[uses[0].name]["parameters"])


def test_speculative_decoding_keeps_greedy_answers_and_validates(server, spec_server):
    with openai_sdk(server) as plain, openai_sdk(spec_server) as spec:
        for schema in SCHEMAS.values():
            want, _ = chat_json(plain, schema, stream=False, temperature=0.0)
            got, _ = chat_json(spec, schema, stream=False, temperature=0.0)
            assert got == want
            jsonschema.validate(json.loads(got), schema)
            sampled, _ = chat_json(spec, schema, stream=True, temperature=1.0, seed=3)
            jsonschema.validate(json.loads(sampled), schema)


def test_a_schema_that_cannot_be_used_is_a_400(server):
    bad = {"type": "object", "properties": {"a": {"type": "strng"}}}
    with openai_sdk(server) as client:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
        for extra in (
            {"response_format": fmt},
            {"response_format": {"type": "xml"}},
            {"extra_body": {"grammar": "root ::= ("}},
            {"extra_body": {"json_schema": bad, "grammar": 'root ::= "a"'}},
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=4, **extra)
            assert caught.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match=r"text\.format"):
            client.responses.create(
                model=MODEL_ID,
                input="x",
                text={"format": {"type": "json_schema", "name": "x", "schema": bad}},
            )
    with claude_client(server) as client:
        for fmt in ({"type": "json_schema", "schema": bad}, {"type": "text"}):
            with pytest.raises(anthropic.BadRequestError, match=r"output_config\.format") as caught:
                client.messages.create(
                    model=MODEL_ID,
                    messages=ASK,
                    max_tokens=4,
                    extra_body={"output_config": {"format": fmt}},
                )
            assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_requests_without_a_constraint_are_unchanged(server):
    """An unconstrained request decodes the same tokens alone and beside a constrained one."""
    engine = server.state.engine
    tok = engine.tokenizer
    prompt = tok.encode("<|im_start|>user\nWrite a function<|im_end|>\n<|im_start|>assistant\n")
    plain = GenerationRequest(prompt, SamplingParams(temperature=0.0), max_tokens=40)
    constrained = Constraint.json_schema(SCHEMAS["arrays and enums"])

    def run(*requests):
        engine.start()
        streams = [engine.add(r) for r in requests]
        deadline = time.monotonic() + 60
        while not all(s.finish for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        return streams

    alone = run(plain)[0].token_ids
    beside = run(
        GenerationRequest(prompt, SamplingParams(temperature=0.0), max_tokens=40),
        GenerationRequest(
            prompt, SamplingParams(temperature=0.0), max_tokens=200, constraint=constrained
        ),
    )
    assert beside[0].token_ids == alone
    jsonschema.validate(json.loads(beside[1].text), SCHEMAS["arrays and enums"])


def test_a_template_without_a_call_form_gets_the_whole_call():
    """SmolLM2's template teaches no call form: the grammar writes the opening too."""

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [1, 2, 3]

    grammar = call_grammar(None, ForcedCall(None), OAI_TOOLS, Tok())
    assert grammar.startswith('start: "<tool_call>" "\\n" call "\\n" "</tool_call>"')
    assert call_grammar(None, None, OAI_TOOLS, Tok()) is None


def test_a_rounds_rows_are_masked_after_its_drafts_and_rolled_back(server):
    """Row i is masked by the grammar after drafts[:i]; a refused draft is out of its own
    row (so it is rejected) and the matcher ends where it began."""
    from ninfer_core.engine.constraints import mask_round_grammar
    from ninfer_core.engine.request import RequestState
    from ninfer_core.engine.sequence import Sequence

    engine = server.state.engine
    tok, vocab = engine.tokenizer, engine.vocab_size
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    request = GenerationRequest([1, 2], constraint=Constraint.json_schema(schema))
    live = RequestState(request, Sequence([1, 2], max_tokens=50), lambda e: None, tok, {2})
    good = tok.encode('{"n": ', add_special_tokens=False)
    bad = tok.encode("x", add_special_tokens=False)[0]
    drafts = [*good, bad, good[0]]
    rows = torch.zeros(len(drafts) + 1, vocab)
    masked = mask_round_grammar(rows, live, drafts, engine.grammars)
    before = live.grammar.allowed()
    for i, token in enumerate(good):  # each draft allowed in its own row
        assert masked[i, token] == 0
    assert masked[len(good), bad] == float("-inf")  # refused where it stands
    assert masked[0, tok.encode("[", add_special_tokens=False)[0]] == float("-inf")
    assert (live.grammar.allowed() == before).all()  # rolled back
    assert masked[len(good) + 1].eq(0).all()  # past the refusal: never read, left as is


def test_completions_take_response_format(server):
    schema = SCHEMAS["optional fields"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with openai_sdk(server) as client:
        text = completion_text(client, "A task:", extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(text), schema)
