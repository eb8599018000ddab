"""Schemas, tools and SDK helpers shared by the constrained-decoding tests."""

from __future__ import annotations

import anthropic
import openai
from serve_fixtures import MODEL_ID

SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "arrays and enums": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 99},
                        "ok": {"type": "boolean"},
                    },
                    "required": ["id", "ok"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
        },
        "required": ["tags", "items"],
        "additionalProperties": False,
    },
    "numbers with bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 65},
            "score": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["age", "score", "level"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 16},
            "done": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 12},
        },
        "required": ["title", "done"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "Describe a user as JSON."}]
WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "name": "get_time",
    "description": "the time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["offset"],
        "additionalProperties": False,
    },
}
TOOLS = {tool["name"]: tool for tool in (WEATHER, CLOCK)}
OAI_TOOLS = [{"type": "function", "function": tool} for tool in (WEATHER, CLOCK)]
CLAUDE_TOOLS = [
    {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
    for t in (WEATHER, CLOCK)
]
ASK_TOOL = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 400


def chat_answer(client: openai.OpenAI, *, stream: bool, **kwargs) -> tuple[str | None, list, str]:
    """(the answer's text, its tool calls as (name, arguments), its finish reason) for a
    chat request of `kwargs` (the served model and `MAX_TOKENS` unless they say otherwise),
    whole or streamed: a stream's deltas are joined, so both read the same."""
    kwargs = {"model": MODEL_ID, "max_tokens": MAX_TOKENS, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    text, streamed, reason = [], {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or []:
                streamed[call.index] = (call.function.name, call.function.arguments)
    return "".join(text), list(streamed.values()), reason


def chat_json(client: openai.OpenAI, schema: dict, *, stream: bool, temperature: float, seed=0):
    """(the answer's text, its finish reason) for a chat request under `schema`."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    text, _, reason = chat_answer(
        client, stream=stream, messages=ASK, temperature=temperature, seed=seed, response_format=fmt
    )
    return text, reason


def claude_message(client: anthropic.Anthropic, *, stream: bool, **kwargs):
    """The message answering a request of `kwargs` (the served model and `MAX_TOKENS` unless
    they say otherwise), whole or the stream's final one."""
    kwargs = {"model": MODEL_ID, "max_tokens": MAX_TOKENS, **kwargs}
    if stream:
        with client.messages.stream(**kwargs) as events:
            return events.get_final_message()
    return client.messages.create(**kwargs)


def claude_json(client: anthropic.Anthropic, schema: dict, *, stream: bool, temperature: float):
    """(the answer's text, its stop reason) for a message under `schema`."""
    message = claude_message(
        client,
        stream=stream,
        messages=ASK,
        extra_body={
            "temperature": temperature,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    return "".join(b.text for b in message.content if b.type == "text"), message.stop_reason


def completion_text(client: openai.OpenAI, prompt: str, **kwargs) -> str:
    """The text of a `/v1/completions` answer to `prompt` (the served model and `MAX_TOKENS`
    unless `kwargs` say otherwise)."""
    kwargs = {"model": MODEL_ID, "max_tokens": MAX_TOKENS, **kwargs}
    return client.completions.create(prompt=prompt, **kwargs).choices[0].text
