"""The model's answer as Responses output items, and the stream events that build them.

`ChatOutput` (the OpenAI frontend's parser) splits the text into reasoning, content and tool
calls; `ItemAssembler` turns its pieces into items in the order they came: a `reasoning`
item, `message` items with one `output_text` part, and a `function_call` item per call. The
streamed and the whole answer go through the same assembler, so they always hold the same
items. An item opens only on text that is not whitespace alone (whitespace before it is kept
and prepended), so the newlines a model writes around a tool call open no empty message.
"""

from __future__ import annotations

import uuid
from typing import Any

from ninfer_core.text.tool_calls import ToolCall
from ninfer_plugins.frontend_openai.output import Piece
from ninfer_plugins.frontend_responses import wire

#: An event before it is numbered and sent: its `type` and its other fields.
Event = tuple[str, dict[str, Any]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ItemAssembler:
    def __init__(self) -> None:
        self.items: list[wire.OutputItem] = []
        self._open: wire.MessageItem | wire.ReasoningItem | None = None
        #: Whitespace waiting for an item of its kind to open.
        self._held: tuple[str, str] = ("", "")

    @property
    def reasoning(self) -> str:
        return "".join(
            c.text for i in self.items if isinstance(i, wire.ReasoningItem) for c in i.content
        )

    def piece(self, piece: Piece) -> list[Event]:
        events = self._text("reasoning", piece.reasoning) + self._text("message", piece.content)
        for call in piece.calls:
            events += self._close("completed") + self._call(call)
        return events

    def finish(self, status: wire.Status) -> list[Event]:
        """Close the open item (`status` "incomplete" when the budget cut it off); an answer
        with nothing in it still gets its (empty) message."""
        events = self._close(status)
        if not self.items:
            events += self._opened("message", self._held[1] if self._held[0] == "message" else "")
            events += self._close(status)
        return events

    # -- text items --------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[Event]:
        if not text:
            return []
        item = self._open
        if item is not None and _kind(item) == kind:
            _part(item).text += text
            return [_delta(kind, item, len(self.items) - 1, text)]
        held = self._held[1] if self._held[0] == kind else ""
        if not text.strip():
            self._held = (kind, held + text)
            return []
        self._held = ("", "")
        return self._close("completed") + self._opened(kind, held + text)

    def _opened(self, kind: str, text: str) -> list[Event]:
        if kind == "message":
            item: wire.MessageItem | wire.ReasoningItem = wire.MessageItem(
                new_id("msg"), "in_progress", [wire.OutputText("")]
            )
            added = wire.MessageItem(item.id, "in_progress", [])
        else:
            item = wire.ReasoningItem(new_id("rs"), "in_progress", [wire.ReasoningText("")])
            added = wire.ReasoningItem(item.id, "in_progress", [])
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events: list[Event] = [
            ("response.output_item.added", {"output_index": index, "item": added}),
            (
                "response.content_part.added",
                {"item_id": item.id, "output_index": index, "content_index": 0,
                 "part": _empty_part(kind)},
            ),
        ]  # fmt: skip
        if text:
            _part(item).text = text
            events.append(_delta(kind, item, index, text))
        return events

    def _close(self, status: wire.Status) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        index = self.items.index(item)
        part = _part(item)
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        if isinstance(item, wire.MessageItem):
            done: Event = (
                "response.output_text.done",
                {**where, "text": part.text, "logprobs": []},
            )
        else:
            done = ("response.reasoning_text.done", {**where, "text": part.text})
        return [
            done,
            ("response.content_part.done", {**where, "part": part}),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]

    # -- function calls ----------------------------------------------------------------

    def _call(self, call: ToolCall) -> list[Event]:
        item = wire.FunctionCallItem(new_id("fc"), call.id, call.name, "", "in_progress")
        added = wire.FunctionCallItem(item.id, call.id, call.name, "", "in_progress")
        self.items.append(item)
        index = len(self.items) - 1
        item.arguments, item.status = call.arguments, "completed"
        where = {"item_id": item.id, "output_index": index}
        return [
            ("response.output_item.added", {"output_index": index, "item": added}),
            ("response.function_call_arguments.delta", {**where, "delta": call.arguments}),
            (
                "response.function_call_arguments.done",
                {**where, "name": call.name, "arguments": call.arguments},
            ),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]


def _kind(item: wire.MessageItem | wire.ReasoningItem) -> str:
    return "message" if isinstance(item, wire.MessageItem) else "reasoning"


def _part(item: wire.MessageItem | wire.ReasoningItem) -> wire.OutputText | wire.ReasoningText:
    return item.content[0]


def _empty_part(kind: str) -> wire.OutputText | wire.ReasoningText:
    return wire.OutputText("") if kind == "message" else wire.ReasoningText("")


def _delta(kind: str, item: wire.MessageItem | wire.ReasoningItem, index: int, text: str) -> Event:
    where = {"item_id": item.id, "output_index": index, "content_index": 0, "delta": text}
    if kind == "message":
        return ("response.output_text.delta", {**where, "logprobs": []})
    return ("response.reasoning_text.delta", where)
