"""Tool calls and reasoning parsed back from model output, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from ninfer_core.text.reasoning import ReasoningSplitter
from ninfer_core.text.tool_calls import ToolCallParser, parse_tool_block, parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]

JSON_OUTPUT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
XML_OUTPUT = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def stream(parser: ToolCallParser, text: str, rng: random.Random) -> str:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(parser.feed(text[i : i + n]))
        i += n
    out.append(parser.finish())
    return "".join(out)


def test_qwen_json_calls():
    content, calls = parse_tool_calls(JSON_OUTPUT, TOOLS)
    assert content == "Let me check.\n\n"
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert calls[0].arguments_dict == {"city": "Paris", "days": 3}
    assert calls[1].arguments_dict == {"city": "Oslo"}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_xml_style_calls_are_typed_by_the_schema():
    content, [call] = parse_tool_calls(XML_OUTPUT, TOOLS)
    assert content == ""
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "San José", "days": 2}


@pytest.mark.parametrize(
    "body",
    [
        "{not json}",
        '{"arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": "{broken"}',
        "just words",
    ],
)
def test_malformed_blocks_degrade_to_text(body):
    text = f"before <tool_call>{body}</tool_call> after"
    content, calls = parse_tool_calls(text, TOOLS)
    assert calls == []
    assert content == text
    assert parse_tool_block(body) is None


def test_unclosed_block_is_parsed_if_complete_else_text():
    unclosed = '<tool_call>{"name": "get_weather", "arguments": {}}'
    content, [call] = parse_tool_calls(unclosed, TOOLS)
    assert content == "" and call.name == "get_weather"
    content, calls = parse_tool_calls('ok <tool_call>{"name": ', TOOLS)
    assert calls == [] and content == 'ok <tool_call>{"name": '


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "/etc/passwd"}}\n</tool_call>',
        "<tool_call>\n<function=read_file>\n<parameter=path>\n/x\n</parameter>\n"
        "</function>\n</tool_call>",
        '<tool_call>{"name": "read_file", "arguments": {}}',  # unclosed
    ],
)
def test_a_call_to_a_tool_not_offered_stays_text(text):
    content, calls = parse_tool_calls("Sure. " + text, TOOLS)
    assert calls == [] and content == "Sure. " + text
    parser = ToolCallParser(TOOLS)
    assert stream(parser, text, random.Random(0)) == text and parser.calls == []
    # Without tools to check against (a caller that offers none), any name is a call.
    assert [c.name for c in parse_tool_calls(text)[1]] == ["read_file"]


@pytest.mark.parametrize("seed", range(20))
def test_streaming_equals_whole(seed):
    rng = random.Random(seed)
    for text in (JSON_OUTPUT, XML_OUTPUT, "plain <tool_ text with < and <tool_call", "a<b"):
        whole_content, whole_calls = parse_tool_calls(text, TOOLS)
        parser = ToolCallParser(TOOLS)
        assert stream(parser, text, rng) == whole_content
        assert [(c.name, c.arguments) for c in parser.calls] == [
            (c.name, c.arguments) for c in whole_calls
        ]


@pytest.mark.parametrize("seed", range(10))
def test_reasoning_split_streamed(seed):
    rng = random.Random(seed)
    text = "<think>\nThe user wants x.\n</think>\n\nThe answer is <b>x</b>."
    split = ReasoningSplitter()
    reasoning, content, i = [], [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        r, c = split.feed(text[i : i + n])
        reasoning.append(r)
        content.append(c)
        i += n
    r, c = split.finish()
    assert "".join(reasoning) + r == "\nThe user wants x.\n"
    assert "".join(content) + c == "The answer is <b>x</b>."


def test_reasoning_opened_by_the_prompt():
    split = ReasoningSplitter(start_inside=True)
    assert split.feed("hmm</think>\n\nyes") == ("hmm", "yes")
    assert ReasoningSplitter().feed("no thinking here") == ("", "no thinking here")
