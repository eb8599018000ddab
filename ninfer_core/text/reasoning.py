"""Reasoning text (`<think>…</think>`) separated from the answer, as it streams.

Qwen3-style templates may open the think block in the prompt itself (the output
then starts inside it), or the model writes `<think>` first; both are handled.
"""

from __future__ import annotations

from ninfer_core.text.tagged_stream import TagSplitter

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    """`feed(delta) -> (reasoning, content)`; `finish()` likewise for the held tail."""

    def __init__(self, *, start_inside: bool = False) -> None:
        self._split = TagSplitter(THINK_OPEN, THINK_CLOSE, start_inside=start_inside)
        self._seen_content = False

    def feed(self, delta: str) -> tuple[str, str]:
        return self._route(self._split.feed(delta))

    def finish(self) -> tuple[str, str]:
        return self._route(self._split.finish())

    def _route(self, segments) -> tuple[str, str]:
        reasoning, content = [], []
        for seg in segments:
            if seg.inside:
                reasoning.append(seg.text)
            else:
                text = seg.text
                if not self._seen_content:
                    # The newlines a template puts after </think> are not part of the answer.
                    text = text.lstrip("\n")
                    self._seen_content = bool(text)
                content.append(text)
        return "".join(reasoning), "".join(content)
