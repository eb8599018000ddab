"""Stop tokens and stop strings, applied to streamed text.

A stop string can arrive split over several deltas ("</to" + "ol>"), so text that might be
the start of one is held back until the next delta settles it: each step emits everything
except the longest tail that is a prefix of some stop string. Nothing emitted is ever taken
back, which is what a streaming client needs.

When several stop strings are present, the one that *ends* first wins: that is the one a
token-by-token stream would have met first, so the result does not depend on how the text
was chunked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class StopUpdate:
    """What one step of generation yields to the client."""

    #: text safe to emit now
    text: str
    #: "stop" once a stop token or stop string ended generation, else None
    finish_reason: Literal["stop"] | None = None
    #: the stop string or stop token id that ended it
    matched: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Tracks one sequence's output against its stop token ids and stop strings."""

    def __init__(
        self,
        stop_token_ids: Iterable[int] = (),
        stop_strings: Sequence[str] = (),
        include_stop_str: bool = False,
    ) -> None:
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)  # "" would match everywhere
        #: emit the stop string (or a stop token's text) itself before stopping
        self.include_stop_str = include_stop_str
        self._held = ""
        self._final: StopUpdate | None = None

    @property
    def finished(self) -> bool:
        return self._final is not None

    def feed(self, text: str, token_id: int | None = None) -> StopUpdate:
        """Take the token just sampled and its text delta; say what to emit and whether
        generation is over. After the end, every call returns "" and the same reason."""
        if self._final is not None:
            return StopUpdate("", self._final.finish_reason, self._final.matched)
        if token_id is not None and token_id in self.stop_token_ids:
            out = self._held + (text if self.include_stop_str else "")
            return self._stop(out, token_id)
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            end = start + len(stop)
            return self._stop(buffer[: end if self.include_stop_str else start], stop)
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return StopUpdate(buffer[: len(buffer) - keep])

    def flush(self) -> str:
        """The held-back text, for when generation ends some other way (length, cancel)."""
        held, self._held = self._held, ""
        return "" if self._final is not None else held

    def _stop(self, text: str, matched: str | int) -> StopUpdate:
        self._held = ""
        self._final = StopUpdate("", "stop", matched)
        return StopUpdate(text, "stop", matched)

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first; on a tie, the longest."""
        best: tuple[int, int, str] | None = None  # (end, -length, string)
        for stop in self.stop_strings:
            start = buffer.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                best = key if best is None or key < best else best
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that a stop string starts with."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
