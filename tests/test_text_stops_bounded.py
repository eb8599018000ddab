"""Stop checking costs O(new text) per step, whatever the number of stop strings, and still
finds every stop string however the stream cuts it.

The work is counted, never timed: the automaton's transition lookups are counted through a
dict that counts, and the stop strings themselves are objects that count every use. The
references are `str.find` over the whole text (which stop ends first) and a brute-force
"longest tail that starts a stop" for what may be held back.
"""

from __future__ import annotations

import random

import pytest

from ninfer_core.text import StopChecker
from ninfer_core.text.stops import StopAutomaton


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(end, stop) of the stop string that ends first in `text`, longest on a tie."""
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return None
    end, _, stop = min(hits)
    return end, stop


def longest_partial(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    return max(
        (n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
        default=0,
    )


def chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(0, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("include", [False, True])
def test_many_overlapping_stops_stream_like_a_whole_text_scan(include):
    rng = random.Random(99)
    alphabet = "abc<>/"
    for _ in range(150):
        stops = ["".join(rng.choices(alphabet, k=rng.randrange(1, 7))) for _ in range(60)]
        text = "".join(rng.choices(alphabet, k=rng.randrange(1, 80)))
        hit = first_stop(text, stops)
        checker = StopChecker(stop_strings=stops, include_stop_str=include)
        out, seen, last = "", "", None
        for piece in chunks(text, rng):
            last = checker.feed(piece)
            out += last.text
            seen += piece
            if last.finished:
                break
            # everything is out except the tail that may still become a stop string
            assert out == seen[: len(seen) - longest_partial(seen, stops)], (stops, seen)
        if hit is None:
            assert not last.finished and out + checker.flush() == text
        else:
            end, stop = hit
            assert last.finished and last.matched == stop, (stops, text)
            assert out == text[: end if include else end - len(stop)]


def test_ten_thousand_stops_find_one_split_over_token_boundaries():
    rng = random.Random(5)
    words = {"".join(rng.choices("abcdefghij", k=rng.randrange(4, 12))) for _ in range(10_000)}
    stops = sorted(words)
    target = stops[1234]
    filler = "".join(rng.choices("klmnop qrst", k=300))
    text = filler + target + filler
    expected = first_stop(text, stops)
    assert expected is not None and expected[1] == target
    checker = StopChecker(stop_strings=stops)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # the stop spans 3-char tokens
    out = ""
    for piece in pieces:
        update = checker.feed(piece)
        out += update.text
        if update.finished:
            break
    assert update.matched == target and out == filler


class CountingDict(dict):
    lookups = 0

    def get(self, key, default=None):
        CountingDict.lookups += 1
        return super().get(key, default)


@pytest.mark.parametrize("n_stops", [1, 100, 10_000])
def test_transitions_per_character_do_not_grow_with_the_stop_count(n_stops):
    rng = random.Random(n_stops)
    stops = ["".join(rng.choices("ab", k=rng.randrange(2, 16))) + "!" for _ in range(n_stops)]
    automaton = StopAutomaton(stops)
    automaton.goto = CountingDict(automaton.goto)
    checker = StopChecker(stop_strings=stops)
    checker._automaton = automaton
    text = "".join(rng.choices("ab", k=5000))  # prefixes everywhere, never a whole stop
    CountingDict.lookups = 0
    for i in range(0, len(text), 4):
        assert not checker.feed(text[i : i + 4]).finished
    # One successful lookup per character, plus fail steps that never outnumber them.
    assert CountingDict.lookups <= 2 * len(text)


class CountingStr(str):
    uses = 0

    def __getitem__(self, key):
        CountingStr.uses += 1
        return super().__getitem__(key)

    def __len__(self):
        CountingStr.uses += 1
        return super().__len__()

    def __iter__(self):
        CountingStr.uses += 1
        return super().__iter__()


def test_feeding_never_touches_the_stop_strings_after_construction():
    """The old checker sliced and measured every stop string on every token."""
    stops = [CountingStr(f"<stop{i}>") for i in range(500)]
    checker = StopChecker(stop_strings=stops)
    CountingStr.uses = 0
    for _ in range(200):
        checker.feed("text <sto")
    assert CountingStr.uses == 0


def test_equal_stop_lists_share_one_automaton_and_flush_resets_the_state():
    a = StopChecker(stop_strings=["</end>", "STOP"])
    b = StopChecker(stop_strings=["</end>", "STOP"])
    assert a._automaton is b._automaton
    assert a.feed("x </en").text == "x "
    assert a.flush() == "</en"
    assert a.feed("d>").text == "d>"  # a fresh start: "</en" is gone
