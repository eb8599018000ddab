"""The model's streamed text → Anthropic content blocks, as stream events.

One `BlockAssembler` serves both answers: a streamed response sends its events as they
come, a plain one sends the `blocks` they built. So the two can never disagree about
where a block starts or what it holds.

Text goes through the `<think>` splitter first (thinking blocks), then the tool-call
parser (tool_use blocks). Whitespace at a block's edges — the newlines Qwen writes
around `<think>` and `<tool_call>` — is dropped: whitespace alone opens no block, a
block starts after its leading newlines, and trailing whitespace is held until more
text follows (Anthropic's own blocks never end in whitespace).
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Literal

from ninfer_core.text.reasoning import ReasoningSplitter
from ninfer_core.text.tool_calls import ToolCall, ToolCallParser

Event = dict[str, Any]
TextKind = Literal["text", "thinking"]
_PIECES = re.compile(r"[^>]*>|[^>]+")


class BlockAssembler:
    """`feed(delta)` and `finish()` return the `content_block_*` events the text made."""

    def __init__(
        self,
        tools: list[dict[str, Any]] | None,
        *,
        parse_tools: bool,
        thinking_open: bool = False,
    ) -> None:
        self._reasoning = ReasoningSplitter(start_inside=thinking_open)
        self._calls = ToolCallParser(tools) if parse_tools else None
        self._taken = 0  # tool calls already turned into blocks
        #: The blocks so far, in their final (non-streamed) shape.
        self.blocks: list[dict[str, Any]] = []
        self._open: TextKind | None = None
        self._held = ""  # trailing whitespace of the open block
        self._lead = ""  # whitespace that may start the next block

    @property
    def has_tool_use(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks)

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        # Cut after every ">", where a tag can end: a piece then holds at most one tag, at
        # its end, so text and the block that tag closes come out in the order written,
        # even when one delta carries many tokens.
        for piece in _PIECES.findall(delta):
            thinking, content = self._reasoning.feed(piece)
            events += self._route(thinking, content, final=False)
        return events

    def finish(self) -> list[Event]:
        thinking, content = self._reasoning.finish()
        return self._route(thinking, content, final=True) + self._close()

    def _route(self, thinking: str, content: str, *, final: bool) -> list[Event]:
        events = self._text("thinking", thinking) if thinking else []
        if self._calls is None:
            return events + (self._text("text", content) if content else [])
        text = self._calls.feed(content) if content else ""
        if final:
            text += self._calls.finish()
        if text:
            events += self._text("text", text)
        while self._taken < len(self._calls.calls):
            events += self._tool_use(self._calls.calls[self._taken])
            self._taken += 1
        return events

    def _text(self, kind: TextKind, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open != kind:
            self._lead += text
            if not self._lead.strip():
                return events  # whitespace alone opens no block
            # Newlines around tags go; leading spaces stay (" 4." continuing a prefill).
            text, self._lead = self._lead.lstrip("\n"), ""
            events += self._close()
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            events.append(_start(len(self.blocks), dict(block)))
            self.blocks.append(block)
            self._open = kind
        body = self._held + text
        cut = len(body.rstrip())
        emit, self._held = body[:cut], body[cut:]
        if emit:
            self.blocks[-1][kind] += emit
            delta = {"type": f"{kind}_delta", kind: emit}
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": delta})  # fmt: skip
        return events

    def _tool_use(self, call: ToolCall) -> list[Event]:
        events, self._lead = self._close(), ""
        index = len(self.blocks)
        block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call.name}
        events.append(_start(index, block | {"input": {}}))
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
        self.blocks.append(block | {"input": call.arguments_dict})
        return events

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open, self._held = None, ""
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _start(index: int, block: dict[str, Any]) -> Event:
    return {"type": "content_block_start", "index": index, "content_block": block}
