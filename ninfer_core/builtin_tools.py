"""The tool definitions of the built-in model's agent transcripts.

The demo model (`builtin_model.py`) was trained on synthetic transcripts that offer
exactly these tools (`tools/builtin_corpus.py` writes them); prompts that are to look
like its training data, such as `ninfer bench spec`'s held-out tool turns, must offer
the same definitions byte for byte, so both read them from here.
"""

from __future__ import annotations

#: `get_weather`'s units, in the order the corpus draws them from.
UNITS = ["celsius", "fahrenheit"]


def _fn(name: str, description: str, props: dict[str, dict], required: list[str]) -> dict:
    """An OpenAI-style function tool."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


#: name -> its definition, as the transcripts show it.
TOOLS: dict[str, dict] = {
    "get_weather": _fn(
        "get_weather",
        "Get the current weather in a city.",
        {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": UNITS},
        },
        ["city"],
    ),
    "read_file": _fn("read_file", "Read a text file.", {"path": {"type": "string"}}, ["path"]),
    "search_code": _fn(
        "search_code",
        "Search the repository for a pattern.",
        {"pattern": {"type": "string"}, "path": {"type": "string"}},
        ["pattern"],
    ),
    "calculator": _fn(
        "calculator",
        "Evaluate an arithmetic expression.",
        {"expression": {"type": "string"}},
        ["expression"],
    ),
    "send_email": _fn(
        "send_email",
        "Send an email.",
        {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        ["to", "subject", "body"],
    ),
}
