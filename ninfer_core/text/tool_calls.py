"""Tool calls parsed back from the model's own output format.

Two formats are understood inside `<tool_call>…</tool_call>`:
- JSON, as Qwen2.5/Qwen3 write it: `{"name": "get_weather", "arguments": {"city": "Paris"}}`;
- XML-style, as Qwen3-Coder writes it:
  `<function=get_weather><parameter=city>Paris</parameter></function>`.
A block that parses as neither is kept as plain text: malformed model output
degrades to content, it never fails the request. So is a call to a tool the request did
not offer (when tools are given): a client must never receive a call it cannot run.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.text.tagged_stream import TagSplitter

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    #: The arguments as a JSON object text, the way both APIs carry them.
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def arguments_dict(self) -> dict[str, Any]:
        return json.loads(self.arguments)


def _xml_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text, typed by the tool's JSON schema when it says so."""
    value = raw.strip("\n")
    kind = (schema or {}).get("type")
    if kind in ("integer", "number", "boolean", "object", "array", "null"):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def parse_tool_block(block: str, tools: list[dict[str, Any]] | None = None) -> ToolCall | None:
    """One `<tool_call>` body → a ToolCall, or None when it is not a well-formed call."""
    body = block.strip()
    if body.startswith("{"):
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(data["name"], json.dumps(args, ensure_ascii=False))
    match = _FUNCTION.search(body)
    if match is None:
        return None
    name = match.group(1)
    props = _tool_properties(tools, name)
    args = {k: _xml_value(v, props.get(k)) for k, v in _PARAMETER.findall(match.group(2))}
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _tool_name(tool: dict[str, Any]) -> str | None:
    """A tool's name, in the OpenAI shape (`{"function": {"name"}}`) or a flat one."""
    return tool.get("function", tool).get("name")


def _tool_properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            params = fn.get("parameters") or fn.get("input_schema") or {}
            return params.get("properties") or {}
    return {}


class ToolCallParser:
    """Streams content text out and collects tool calls as their blocks close.

    `feed(delta)` returns content text safe to emit; a tool-call body is held until
    its closing tag and then parsed. `finish()` returns the remaining content. A
    block that does not parse (or never closes) comes back as content text.
    """

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools
        #: The names a call may have; None: any (no tools given to check against).
        self.names = None if tools is None else {_tool_name(t) for t in tools}
        self.calls: list[ToolCall] = []
        self._split = TagSplitter(TOOL_OPEN, TOOL_CLOSE)
        self._block: list[str] = []

    def feed(self, delta: str) -> str:
        return self._route(self._split.feed(delta), final=False)

    def finish(self) -> str:
        return self._route(self._split.finish(), final=True)

    def _route(self, segments, *, final: bool) -> str:
        out: list[str] = []
        for seg in segments:
            if not seg.inside:
                out.append(seg.text)
                continue
            self._block.append(seg.text)
            if seg.closes:
                out.append(self._close(closed=True))
        if final and self._split.inside:
            out.append(self._close(closed=False))
        return "".join(out)

    def _close(self, *, closed: bool) -> str:
        """Parse the finished block; return the text to show if it is not a call."""
        body, self._block = "".join(self._block), []
        call = parse_tool_block(body, self.tools)
        if call is not None and (self.names is None or call.name in self.names):
            self.calls.append(call)
            return ""
        return TOOL_OPEN + body + (TOOL_CLOSE if closed else "")


def parse_tool_calls(
    text: str, tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[ToolCall]]:
    """A whole output → (content text, tool calls)."""
    parser = ToolCallParser(tools)
    content = parser.feed(text) + parser.finish()
    return content, parser.calls
