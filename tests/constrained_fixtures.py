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


def chat_json(client: openai.OpenAI, schema: dict, *, stream: bool, temperature: float, seed=0):
    """(the answer's text, its finish reason) for a chat request under `schema`."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    kwargs = dict(
        model=MODEL_ID,
        messages=ASK,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        seed=seed,
        response_format=fmt,
    )
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(text), reason


def claude_json(client: anthropic.Anthropic, schema: dict, *, stream: bool, temperature: float):
    """(the answer's text, its stop reason) for a message under `schema`."""
    kwargs = dict(
        model=MODEL_ID,
        messages=ASK,
        max_tokens=MAX_TOKENS,
        extra_body={
            "temperature": temperature,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    return "".join(b.text for b in message.content if b.type == "text"), message.stop_reason
