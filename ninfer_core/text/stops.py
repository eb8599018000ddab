"""Stop tokens and stop strings, applied to streamed text.

A stop string can arrive split over several deltas ("</to" + "ol>"), so text that might be
the start of one is held back until the next delta settles it: each step emits everything
except the longest tail that is a prefix of some stop string. Nothing emitted is ever taken
back, which is what a streaming client needs.

When several stop strings are present, the one that *ends* first wins: that is the one a
token-by-token stream would have met first, so the result does not depend on how the text
was chunked.

Checking costs O(new text) per step, whatever the number of stop strings: the strings are
compiled once into an Aho–Corasick automaton (`StopAutomaton`), and each step feeds it only
the new characters. Its state *is* the held-back tail — the longest suffix of the text so
far that is a prefix of some stop string — so the text already seen is never scanned again.
A request with 10k stop strings used to cost 10k substring searches per token on the
engine's step thread, slowing every other stream; now it costs a few dict lookups per
character, like a request with one.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

#: Bits for a character in a transition key: `node << _CHAR_BITS | ord(char)`.
_CHAR_BITS = 21


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


class StopAutomaton:
    """Aho–Corasick over a set of stop strings; immutable once built, so requests with the
    same stop strings share one (`for_stops`).

    Nodes are the prefixes of the stop strings (node 0 is ""). `goto` maps
    `node << 21 | ord(char)` to the child node: one flat dict rather than a dict per node,
    about a third of the memory. `fail[n]` is the node of n's longest proper suffix that is
    also a prefix; `depth[n]` its length; `out[n]` the index in `stops` of the longest stop
    string that is a suffix of n's prefix (-1 if none). Building costs O(total length).
    """

    __slots__ = ("depth", "fail", "goto", "out", "stops")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        goto: dict[int, int] = {}
        depth, term = array("l", [0]), array("l", [-1])
        for index, stop in enumerate(self.stops):
            node = 0
            for char in stop:
                key = node << _CHAR_BITS | ord(char)
                child = goto.get(key)
                if child is None:
                    child = goto[key] = len(depth)
                    depth.append(depth[node] + 1)
                    term.append(-1)
                node = child
            if term[node] < 0:
                term[node] = index
        children: list[list[tuple[int, int]]] = [[] for _ in depth]
        for key, child in goto.items():
            children[key >> _CHAR_BITS].append((key & ((1 << _CHAR_BITS) - 1), child))
        fail, out = array("l", [0]) * len(depth), array("l", term)
        queue = deque(child for _, child in children[0])
        while queue:  # breadth first: a node's fail target is shallower, so already done
            node = queue.popleft()
            if out[node] < 0:
                out[node] = out[fail[node]]
            for code, child in children[node]:
                f = fail[node]
                while f and (f << _CHAR_BITS | code) not in goto:
                    f = fail[f]
                fail[child] = goto.get(f << _CHAR_BITS | code, 0)
                queue.append(child)
        self.goto, self.fail, self.depth, self.out = goto, fail, depth, out

    @staticmethod
    @lru_cache(maxsize=16)
    def for_stops(stops: tuple[str, ...]) -> StopAutomaton:
        """The automaton for `stops`, shared by requests that send the same list."""
        return StopAutomaton(stops)

    def scan(self, state: int, text: str) -> tuple[int, int, int]:
        """Feed `text` from `state`: (new state, index in `text` where the first stop string
        ends, exclusive, or -1, that stop's index). Stops at the first match. Amortised O(1)
        per character: each fail step shortens the match that each character lengthened."""
        goto, fail, out = self.goto, self.fail, self.out
        for i, char in enumerate(text):
            code = ord(char)
            while True:
                child = goto.get(state << _CHAR_BITS | code)
                if child is not None:
                    state = child
                    break
                if not state:
                    break
                state = fail[state]
            if out[state] >= 0:
                return state, i + 1, out[state]
        return state, -1, -1


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
        self._automaton = StopAutomaton.for_stops(self.stop_strings) if self.stop_strings else None
        self._state = 0  # the automaton's node: len(self._held) == its depth
        self._held = ""
        self._final: StopUpdate | None = None

    @property
    def finished(self) -> bool:
        return self._final is not None

    def feed(self, text: str, token_id: int | None = None) -> StopUpdate:
        """Take the token just sampled and its text delta; say what to emit and whether
        generation is over. After the end, every call returns "" and the same reason.
        Costs O(len(text) + held), independent of the number of stop strings."""
        if self._final is not None:
            return StopUpdate("", self._final.finish_reason, self._final.matched)
        if token_id is not None and token_id in self.stop_token_ids:
            out = self._held + (text if self.include_stop_str else "")
            return self._stop(out, token_id)
        automaton = self._automaton
        if automaton is None:
            return StopUpdate(text)
        buffer = self._held + text
        self._state, end, index = automaton.scan(self._state, text)
        if end >= 0:
            # The match ends in `text`; it starts within held + text, since the part of it in
            # earlier text is a suffix of that text and a stop's prefix: at most `held`.
            stop = automaton.stops[index]
            end += len(self._held)
            return self._stop(buffer[: end if self.include_stop_str else end - len(stop)], stop)
        keep = automaton.depth[self._state]
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return StopUpdate(buffer[: len(buffer) - keep])

    def flush(self) -> str:
        """The held-back text, for when generation ends some other way (length, cancel)."""
        held, self._held, self._state = self._held, "", 0
        return "" if self._final is not None else held

    def _stop(self, text: str, matched: str | int) -> StopUpdate:
        self._held, self._state = "", 0
        self._final = StopUpdate("", "stop", matched)
        return StopUpdate(text, "stop", matched)
