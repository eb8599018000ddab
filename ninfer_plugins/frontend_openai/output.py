"""A chat answer's text split into reasoning, content and tool calls, as it streams.

The reasoning splitter goes first (a `<think>` block is never a tool call), then the tool
parser reads the content, and only when the request offered tools: without them a
`<tool_call>` in the output is just text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer_core.text.reasoning import ReasoningSplitter
from ninfer_core.text.tool_calls import ToolCall, ToolCallParser


@dataclass
class Piece:
    """What one delta (or the end) adds."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChatOutput:
    def __init__(self, tools: list[dict[str, Any]] | None, *, thinking_open: bool) -> None:
        self._reasoning = ReasoningSplitter(start_inside=thinking_open)
        self._tools = ToolCallParser(tools) if tools else None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> Piece:
        reasoning, content = self._reasoning.feed(delta)
        return self._route(reasoning, content, final=False)

    def finish(self) -> Piece:
        reasoning, content = self._reasoning.finish()
        return self._route(reasoning, content, final=True)

    def _route(self, reasoning: str, content: str, *, final: bool) -> Piece:
        piece = Piece(reasoning=reasoning)
        if self._tools is None:
            piece.content = content
        else:
            before = len(self._tools.calls)
            piece.content = self._tools.feed(content)
            if final:
                piece.content += self._tools.finish()
            piece.calls = self._tools.calls[before:]
        self.reasoning.append(piece.reasoning)
        self.content.append(piece.content)
        self.calls.extend(piece.calls)
        return piece
