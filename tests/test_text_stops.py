"""Stop strings are found across deltas, and nothing that may start one is emitted early."""

from __future__ import annotations

import random

import pytest

from ninfer_core.text import StopChecker, StopUpdate


def _oracle(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """What a character-by-character scan of the whole text would emit, and the match."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def _run(checker: StopChecker, chunks: list[str]) -> tuple[str, StopUpdate | None]:
    out, last = "", None
    for chunk in chunks:
        last = checker.feed(chunk)
        out += last.text
        if last.finished:
            return out, last
    return out + checker.flush(), last


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randrange(0, 6))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_stop_string_split_across_deltas() -> None:
    checker = StopChecker(stop_strings=["</tool_call>"])
    assert checker.feed("result: 42 </to").text == "result: 42 "  # "</to" is held back
    update = checker.feed("ol_call> trailing")
    assert update == StopUpdate("", "stop", "</tool_call>")
    assert checker.finished and checker.feed("more") == StopUpdate("", "stop", "</tool_call>")


def test_false_start_is_released() -> None:
    checker = StopChecker(stop_strings=["STOP"])
    assert checker.feed("a ST").text == "a "
    assert checker.feed("ART").text == "START"
    assert checker.feed("S").text == ""
    assert checker.flush() == "S"


def test_holds_longest_suffix_over_all_stops() -> None:
    checker = StopChecker(stop_strings=["abcd", "cx", "bcy"])
    assert checker.feed("zzabc").text == "zz"  # "abc" (of abcd) beats "bc"/"c"
    assert checker.feed("y!").text == "a"  # "bcy" matched: emit up to its start
    assert checker.finished


def test_overlapping_stops_first_to_end_wins() -> None:
    assert _run(StopChecker(stop_strings=["abc", "b"]), ["xabc"])[0] == "xa"
    out, last = _run(StopChecker(stop_strings=["ab", "xab"]), ["zxab"])
    assert (out, last and last.matched) == ("z", "xab")  # same end: the longer one


def test_include_stop_str() -> None:
    out, last = _run(StopChecker(stop_strings=["\n\n"], include_stop_str=True), ["a\n", "\nb"])
    assert out == "a\n\n" and last is not None and last.matched == "\n\n"


def test_stop_token_ids() -> None:
    checker = StopChecker(stop_token_ids=[7, 9], stop_strings=["END"])
    assert checker.feed("so E", token_id=1).text == "so "
    update = checker.feed("", token_id=9)
    assert update == StopUpdate("E", "stop", 9)  # held text is released: it was no stop
    assert checker.flush() == ""
    shown = StopChecker(stop_token_ids=[7], include_stop_str=True).feed("<eot>", token_id=7)
    assert shown.text == "<eot>" and shown.finished


def test_no_stops_passes_text_through() -> None:
    checker = StopChecker(stop_strings=[""])
    assert checker.feed("anything").text == "anything" and not checker.finished


@pytest.mark.parametrize("include", [False, True])
def test_random_chunkings_match_whole_text_scan(include: bool) -> None:
    rng = random.Random(1234)
    alphabet = "ab<>/ "
    for _ in range(400):
        stops = ["".join(rng.choices(alphabet, k=rng.randrange(1, 5))) for _ in range(3)]
        text = "".join(rng.choices(alphabet, k=rng.randrange(2, 30)))
        expected, matched = _oracle(text, stops, include)
        checker = StopChecker(stop_strings=stops, include_stop_str=include)
        out, last = _run(checker, _chunks(text, rng))
        assert out == expected, (text, stops)
        assert (last.matched if last and last.finished else None) == matched
