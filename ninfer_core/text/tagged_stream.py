"""Split a streamed model output at literal tags, holding back what may be a tag's start.

Reasoning (`<think>…</think>`) and tool calls (`<tool_call>…</tool_call>`) arrive as
text deltas; a tag can be cut across deltas, so a tail that could still grow into
the tag being looked for is held until the next delta decides.
"""

from __future__ import annotations

from dataclasses import dataclass


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of text; `inside` a tag pair or not; `closes` when the close tag follows it."""

    text: str
    inside: bool
    closes: bool = False


class TagSplitter:
    """Cuts streamed text into segments outside and inside one tag pair (tags dropped)."""

    def __init__(self, open_tag: str, close_tag: str, *, start_inside: bool = False) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.inside = start_inside
        self._held = ""

    def feed(self, delta: str) -> list[Segment]:
        text, self._held = self._held + delta, ""
        out: list[Segment] = []
        while text:
            tag = self.close_tag if self.inside else self.open_tag
            at = text.find(tag)
            if at >= 0:
                out.append(Segment(text[:at], self.inside, closes=self.inside))
                text = text[at + len(tag) :]
                self.inside = not self.inside
                continue
            keep = partial_suffix(text, tag)
            out.append(Segment(text[: len(text) - keep], self.inside))
            self._held = text[len(text) - keep :]
            break
        return [s for s in out if s.text or s.closes]

    def finish(self) -> list[Segment]:
        """What was held back (a partial tag is just text now)."""
        held, self._held = self._held, ""
        return [Segment(held, self.inside)] if held else []
