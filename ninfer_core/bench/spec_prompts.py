"""The prompts `ninfer bench spec` runs, by content class: code, JSON tool calls, prose.

Speculation pays off by what the output looks like, so the bench reports each class apart:

- **code**: Python to continue or to rewrite. The built-in model (trained on raw stdlib
  source) continues the code as it is; a chat model is asked to rewrite it, which copies
  most of its input (where `ngram` drafts well).
- **json**: agent turns whose answer is a JSON tool call. For the built-in model, held-out
  transcripts of its own corpus (`tools/builtin_corpus.py`, seeds 10**9 + 20261203 + i,
  never trained on) cut after the assistant's `<tool_call>`, so the model writes the call's
  JSON; for any other model, a conversation with tool definitions, one call and its JSON
  result, asking for the next call, through the model's own chat template.
- **prose**: stories and explanations, where neither strategy has structure to lean on.

The texts are written out here (the corpus generator is a repository tool, not part of the
package); `tests/test_bench_spec.py` checks the built-in prompts against the generator.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ninfer_core.builtin_tools import TOOLS
from ninfer_core.errors import NInferError

if TYPE_CHECKING:  # the CLI imports this module to build its options: nothing heavy
    from ninfer_core.generation import PromptText

ContentClass = Literal["code", "json", "prose"]
CLASSES: tuple[ContentClass, ...] = ("code", "json", "prose")


@dataclass(frozen=True)
class CodePrompt:
    name: str
    #: What a chat model is asked to do with `code`.
    instruction: str
    #: Ends mid-body, so a base model has something to continue.
    code: str


@dataclass(frozen=True)
class ToolTurn:
    """The first turn of a held-out built-in transcript: the answer is the tool call."""

    name: str
    #: i of the transcript's seed, 10**9 + 20261203 + i.
    heldout_index: int
    system: str
    user: str
    tools: tuple[str, ...]


@dataclass(frozen=True)
class AgentPrompt:
    """A conversation one call in; the model is to make the next call."""

    name: str
    system: str
    user: str
    tools: tuple[str, ...]
    call: tuple[str, dict[str, Any]]
    result: dict[str, Any]


CODE = (
    CodePrompt(
        "lru-cache",
        "Add type hints to this class and give every method a one-line docstring. "
        "Change nothing else and reply with the whole class.",
        """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key, default=None):
        if key not in self.items:
            return default
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
""",
    ),
    CodePrompt(
        "csv-report",
        "Rename the variable `rows` to `records` everywhere in this function and reply "
        "with the whole function.",
        '''import csv
from collections import defaultdict


def totals_by_region(path):
    """Sum the amount column of a CSV file per region."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append(row)
    totals = defaultdict(float)
    for row in rows:
        region = row["region"].strip().lower()
        totals[region] += float(row["amount"])
    for region in sorted(totals):
''',
    ),
    CodePrompt(
        "cli-main",
        "Finish this command-line tool: add a `--verbose` flag that prints each file "
        "name, and reply with the whole module.",
        """import argparse
import os
import sys


def count_lines(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return sum(1 for _ in f)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Count lines in Python files.")
    parser.add_argument("root", help="folder to search")
    args = parser.parse_args(argv)
    total = 0
    for dirpath, dirnames, filenames in os.walk(args.root):
        for name in filenames:
            if not name.endswith(".py"):
""",
    ),
)

#: Held-out transcripts 2, 4 and 5: three different tools called.
BUILTIN_TOOL_TURNS = (
    ToolTurn(
        "search-code", 2, "You are a helpful assistant.",
        "Where do we use `raise ValueError`?", ("search_code",),
    ),
    ToolTurn(
        "send-email", 4, "You are a helpful assistant.",
        "Email Ada (ada@example.com) about: Build failed.", ("read_file", "send_email"),
    ),
    ToolTurn(
        "get-weather", 5, "You are a helpful assistant.",
        "Is it cold in Nairobi right now?", ("calculator", "get_weather", "send_email"),
    ),
)  # fmt: skip

AGENT = (
    AgentPrompt(
        "search-then-read",
        "You are a coding assistant. Use the tools when they help.",
        "Find where we raise ValueError, then open the first file that does.",
        ("read_file", "search_code"),
        ("search_code", {"pattern": "raise ValueError"}),
        {"matches": [{"file": "src/app.py", "line": 115}, {"file": "setup.cfg", "line": 289}]},
    ),
    AgentPrompt(
        "weather-then-email",
        "You are a helpful assistant.",
        "Check the weather in Oslo and email it to Grace (grace@example.com).",
        ("get_weather", "send_email"),
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        {"city": "Oslo", "temperature": -3, "unit": "celsius", "condition": "snow"},
    ),
    AgentPrompt(
        "read-then-calculate",
        "You are a helpful assistant. Use the calculator for arithmetic.",
        "What do the orders in data/orders.json add up to?",
        ("calculator", "read_file"),
        ("read_file", {"path": "data/orders.json"}),
        {"path": "data/orders.json", "orders": [
            {"id": 1, "total": 19.5}, {"id": 2, "total": 240.0}, {"id": 3, "total": 7.25}]},
    ),
)  # fmt: skip

PROSE = (
    ("lighthouse", "Write a short story about a lighthouse keeper who finds a message in a "
     "bottle."),
    ("hash-table", "Explain to a beginner how a hash table finds a value, and what happens "
     "when two keys collide."),
    ("water-cycle", "Describe the water cycle in a few paragraphs, from the ocean to the "
     "rain and back."),
)  # fmt: skip


def builtin_tool_prompt(turn: ToolTurn) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of a held-out turn, up to the assistant's answer."""
    messages = [{"role": "system", "content": turn.system}, {"role": "user", "content": turn.user}]
    return messages, [TOOLS[t] for t in turn.tools]


def agent_conversation(
    p: AgentPrompt, *, tools_in_text: bool, definitions: Mapping[str, dict] = TOOLS
) -> tuple[list[dict], list | None]:
    """(messages, tools) of an agent prompt. `tools_in_text`: for a template that ignores
    `tools`, the definitions go into the system message and the call and its result into
    plain turns, in the Hermes style most chat models were tuned on. `definitions`: where
    `p.tools` are looked up (other tools than the bench's, for a training set)."""
    tools = [definitions[t] for t in p.tools]
    name, args = p.call
    result = json.dumps(p.result)
    if not tools_in_text:
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        return [
            {"role": "system", "content": p.system},
            {"role": "user", "content": p.user},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": result},
        ], tools
    listing = "\n".join(json.dumps(t) for t in tools)
    system = (
        f"{p.system}\n\nYou may call these functions:\n<tools>\n{listing}\n</tools>\n"
        'Reply with one call as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>'
    )
    call_text = json.dumps({"name": name, "arguments": args})
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": p.user},
        {"role": "assistant", "content": f"<tool_call>\n{call_text}\n</tool_call>"},
        {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"},
    ], None  # fmt: skip


def renders_tools(text: PromptText) -> bool:
    """Whether the model's template shows the tool definitions it is given."""
    assert text.template is not None
    probe = [{"role": "user", "content": "hi"}]
    rendered = text.template.render(probe, tools=[TOOLS["calculator"]], add_generation_prompt=True)
    return "calculator" in rendered


def class_prompts(
    cls: ContentClass, text: PromptText, *, builtin: bool
) -> list[tuple[str, list[int]]]:
    """(name, prompt ids) of every bundled prompt of `cls` for a model. `builtin`: the
    built-in model's prompt forms (raw code, its held-out tool turns)."""
    if cls not in CLASSES:
        raise NInferError(f"unknown content class {cls!r}; known: {', '.join(CLASSES)}")
    if text.template is None:
        raise NInferError(f"{text.path}: the model has no chat template, which the bench needs")
    if cls == "code":
        if builtin:
            return [(p.name, text.tokenizer.encode(p.code, add_special_tokens=False)) for p in CODE]
        return [
            (p.name, text.chat_ids([{"role": "user",
                                     "content": f"{p.instruction}\n\n```python\n{p.code}```"}]))
            for p in CODE
        ]  # fmt: skip
    if cls == "prose":
        return [(name, text.chat_ids([{"role": "user", "content": ask}])) for name, ask in PROSE]
    if builtin:
        out = []
        for turn in BUILTIN_TOOL_TURNS:
            messages, tools = builtin_tool_prompt(turn)
            rendered = text.template.render(messages, tools=tools, add_generation_prompt=True)
            # the model opens its answer with the call; it writes the JSON from here
            ids = text.tokenizer.encode(rendered + "<tool_call>\n", add_special_tokens=False)
            out.append((turn.name, ids))
        return out
    in_text = not renders_tools(text)
    return [(p.name, text.chat_ids(*agent_conversation(p, tools_in_text=in_text))) for p in AGENT]
