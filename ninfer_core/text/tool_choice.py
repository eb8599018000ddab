"""A forced tool choice, enforced without a grammar: the answer starts as the model's call does.

OpenAI's `tool_choice: "required"` / a named function and Anthropic's `{"type": "any"}` /
`{"type": "tool", "name": ...}` must end in a call. vLLM constrains decoding to the tools'
schemas; short of a grammar engine, the assistant turn is prefilled with the opening of the
model's own call form, so the model's next tokens are the call itself:

- any tool: `<tool_call>\\n` — the model writes the name and the arguments (with only one
  tool offered, the choice is that tool's, named as below: `ForcedCall.among`);
- a named tool, JSON form (Qwen2.5/Qwen3): `<tool_call>\\n{"name": "NAME", "arguments":` —
  the model writes the arguments. The prefill stops before the space: Qwen's BPE writes
  ` {` as one token, so a prompt ending in a bare space would ask for a token sequence the
  model never produced;
- a named tool, XML form (Qwen3-Coder, `<function=` in the template):
  `<tool_call>\\n<function=NAME>\\n`.

The opening is appended to the rendered prompt (its tokens count as prompt tokens) and fed
to the output parser before the model's first token, so the parser reads the whole call and
the answer holds a proper tool call. When the prompt ends inside an open `<think>` block the
prompt also gets `</think>\\n\\n` first: a forced call skips the reasoning. A template without
`<tool_call>` in it (another family's call format) gets no prefill: the tools are shown and
the choice stays a request the model may ignore.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ninfer_core.sampling.grammar import JSON_OPTIONS
from ninfer_core.text.reasoning import THINK_CLOSE, THINK_OPEN
from ninfer_core.text.tool_calls import TOOL_CLOSE, TOOL_OPEN

if TYPE_CHECKING:
    from ninfer_core.text.chat_template import ChatTemplate
    from ninfer_core.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ForcedCall:
    """A tool choice that must end in a call: to any of the tools (`name` None) or to one."""

    name: str | None = None

    @classmethod
    def among(cls, names: Sequence[str]) -> ForcedCall:
        """A call to any of the tools `names`: with only one tool that is a call to it, so
        it is forced by name (its name prefilled too) and the model cannot pick another."""
        return cls(names[0] if len(set(names)) == 1 else None)


def call_format(template: ChatTemplate | None) -> Literal["json", "xml"] | None:
    """The call form the template teaches (`<tool_call>` with JSON or `<function=…>`), or
    None when it uses no `<tool_call>` tag and a call cannot be prefilled."""
    source = "\n".join(template.templates.values()) if template is not None else ""
    if TOOL_OPEN not in source:
        return None
    return "xml" if "<function=" in source else "json"


def call_opening(template: ChatTemplate | None, forced: ForcedCall | None) -> str:
    """The text a forced answer starts with, as the model would have written it; "" when
    nothing is forced or the template's call form is not known."""
    form = call_format(template) if forced is not None else None
    if form is None or forced is None:
        return ""
    if forced.name is None:
        return TOOL_OPEN + "\n"
    if form == "xml":
        return f"{TOOL_OPEN}\n<function={forced.name}>\n"
    return f'{TOOL_OPEN}\n{{"name": {json.dumps(forced.name, ensure_ascii=False)}, "arguments":'


def ends_in_thinking(text: str) -> bool:
    """Whether `text` (a prompt's tail) leaves a `<think>` block open."""
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


def with_opening(tokenizer: Tokenizer, prompt_ids: list[int], opening: str) -> list[int]:
    """The prompt ids followed by the call's opening (closing an open `<think>` first).

    The opening is encoded apart from the prompt: it starts at a tag (`<tool_call>`, a
    special token in the models that use it), where the tokenizer splits anyway.
    """
    if not opening:
        return prompt_ids
    if ends_in_thinking(tokenizer.decode(prompt_ids[-32:])):
        opening = f"{THINK_CLOSE}\n\n{opening}"
    return [*prompt_ids, *tokenizer.encode(opening, add_special_tokens=False)]


def _tag(tokenizer: Tokenizer, tag: str) -> str:
    """`tag` in a Lark grammar: by its token id when it is one token (an added token, which
    a literal would never match), else written out."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(tag)


#: JSON as the models write it, no free whitespace (as `sampling/grammar.py`'s schemas):
#: with free whitespace a small model can fill its budget with blanks inside the call.
STRICT_JSON = {"x-guidance": JSON_OPTIONS}


def call_grammar(
    template: ChatTemplate | None,
    forced: ForcedCall | None,
    tools: Sequence[dict] | None,
    tokenizer: Tokenizer,
) -> str | None:
    """A Lark grammar for what follows `call_opening`: the rest of one call in the JSON
    form, to one of `tools` (`forced.name` when named) with arguments that match its
    parameter schema, then `</tool_call>`. None when nothing is forced or the template
    writes calls in the XML form (those stay forced by the prefill alone).

    A template that teaches no call form (no `<tool_call>` in it, so nothing is prefilled)
    gets the whole call, opening included, in the JSON form the output parser reads: the
    model is made to call, where the prefill alone could only ask it to."""
    form = call_format(template)
    if forced is None or form == "xml" or not tools:
        return None
    schemas = {}
    for tool in tools:
        fn = tool.get("function", tool)
        schemas[fn.get("name")] = fn.get("parameters") or fn.get("input_schema") or {}
    close = f'"\\n" {_tag(tokenizer, TOOL_CLOSE)}'
    if form == "json" and forced.name is not None:  # the opening ends with `"arguments":`
        params = {**(schemas.get(forced.name) or {"type": "object"}), **STRICT_JSON}
        return f'start: " " args "}}" {close}\nargs: %json {json.dumps(params)}\n'
    names = [forced.name] if forced.name is not None else list(schemas)
    # Each tool's schema sits under the wrapper's `$defs`, so the references inside it
    # (`#/$defs/...`, as Pydantic and the agent SDKs write them) resolve there, moved.
    defs = {f"tool{i}": moved_refs(schemas.get(name) or {"type": "object"}, f"tool{i}")
            for i, name in enumerate(names)}  # fmt: skip
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, name in enumerate(names)
    ]
    opening = "" if form == "json" else f'{_tag(tokenizer, TOOL_OPEN)} "\\n" '
    wrapper = {"$defs": defs, "anyOf": calls, **STRICT_JSON}
    return f"start: {opening}call {close}\ncall: %json {json.dumps(wrapper)}\n"


def moved_refs(schema: Any, key: str) -> Any:
    """`schema` with each document-local `$ref` (`#`, `#/$defs/X`, `#/properties/...`)
    rewritten for the schema placed at `#/$defs/<key>` of another document."""
    if isinstance(schema, dict):
        moved = {k: moved_refs(v, key) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            moved["$ref"] = f"#/$defs/{key}{ref[1:]}"
        return moved
    if isinstance(schema, list):
        return [moved_refs(v, key) for v in schema]
    return schema
