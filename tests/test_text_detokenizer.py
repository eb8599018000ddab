"""Streamed text equals the decode of the whole sequence and never holds half a character."""

from __future__ import annotations

import random

import pytest
from text_fixtures import DirTexts, write_model_dir

from ninfer_core.text import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Emoji time: 😀🎉👍🏽 and accents: café, naïve, Zürich.",
    "天气很好。我们去公园吧！日本語のテキストも少し。",
    "mixed 東京😀a😀b€𝄞 end",
    "<|im_start|>assistant\n你好 👋<|im_end|><|endoftext|>",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_artifact(DirTexts(write_model_dir(tmp_path_factory.mktemp("detok"))))


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.feed(i) for i in ids] + [detok.finish()]


def test_characters_really_are_split(tokenizer: Tokenizer) -> None:
    """Guard for the tests below: the tiny tokenizer splits 😀 over several tokens."""
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1 and tokenizer.decode(ids[:1]) == "\ufffd"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_deltas_join_to_full_decode(tokenizer: Tokenizer, text: str, skip: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # something was held back while a character was incomplete


def test_each_delta_is_the_decoded_growth(tokenizer: Tokenizer) -> None:
    """Text comes out as soon as it is complete, not later."""
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    emitted = ""
    for n, token in enumerate(ids, start=1):
        emitted += detok.feed(token)
        whole = tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert emitted == whole.rstrip("\ufffd")


def test_random_ids_including_invalid_utf8(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas = _stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids)
        assert "".join(deltas) == tokenizer.decode(ids)


def test_sequence_ending_mid_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.feed(i) for i in ids)
    assert streamed.startswith("ok") and "\ufffd" not in streamed
    rest = detok.finish()
    assert rest.endswith("\ufffd") and streamed + rest == tokenizer.decode(ids) == "ok \ufffd"


def test_context_ids_and_feed_many(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("<|im_start|>user\n东京?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(" 晴れ 😀 sunny", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, context_ids=prompt)
    text = detok.feed_many(ids[:3]) + detok.feed_many(ids[3:]) + detok.finish()
    full, before = tokenizer.decode(prompt + ids), tokenizer.decode(prompt)
    assert text == full[len(before) :] == " 晴れ 😀 sunny"
    assert detok.token_ids == ids
