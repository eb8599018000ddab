"""The tokenizer encodes, decodes and names its special tokens as transformers does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from text_fixtures import CORPUS, DirTexts, reference_tokenizer, write_model_dir

from ninfer_core.errors import ModelLoadError
from ninfer_core.text import SpecialTokens, Tokenizer

SAMPLES = [
    "Hello world!",
    "  leading spaces and\ttabs\n\nnewlines",
    "<|im_start|>user\nhi<|im_end|>\n",  # specials inside text split out as single tokens
    "天气很好 😀🎉 café <s> </s>",
    "",
]

ADDED_BOS = {
    "__type": "AddedToken",
    "content": "<s>",
    "lstrip": False,
    "rstrip": False,
    "normalized": False,
    "single_word": False,
}


def _pair(path: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_artifact(DirTexts(path)), reference_tokenizer(path)


@pytest.mark.parametrize(
    ("config", "bos"),
    [
        pytest.param({}, None, id="qwen-like"),
        # transformers ignores add_bos_token when tokenizer.json exists: the post-processor decides
        pytest.param({"bos_token": "<s>", "add_bos_token": True}, None, id="bos-not-in-vocab"),
        pytest.param({"bos_token": "<s>", "add_bos_token": False}, "<s>", id="bos-post-processor"),
        pytest.param({"bos_token": ADDED_BOS}, "<s>", id="bos-added-token-dict"),
    ],
)
def test_matches_transformers(tmp_path: Path, config: dict[str, Any], bos: str | None) -> None:
    ours, ref = _pair(write_model_dir(tmp_path, config=config, bos=bos))
    for text in [*SAMPLES, *CORPUS[:7]]:
        for specials in (True, False):
            ids = ours.encode(text, add_special_tokens=specials)
            assert ids == ref.encode(text, add_special_tokens=specials), (text, specials)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip
                )
    assert ours.vocab_size == len(ref)
    assert ours.special_tokens.template_vars() == ref.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    assert ours.adds_bos == (bos is not None)
    assert ours.all_special_ids == set(ref.all_special_ids) | {
        i for i, t in ref.added_tokens_decoder.items() if t.special
    }


def test_token_lookup(tmp_path: Path) -> None:
    ours = Tokenizer.from_artifact(DirTexts(write_model_dir(tmp_path)))
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end is not None and ours.id_to_token(im_end) == "<|im_end|>"
    assert ours.eos_token_id == im_end
    assert ours.token_to_id("<definitely not a token>") is None
    assert ours.bos_token_id is None and not ours.adds_bos


def test_special_tokens_map_is_legacy_fallback(tmp_path: Path) -> None:
    """special_tokens_map.json counts only without added_tokens_decoder, and then wins."""
    path = write_model_dir(
        tmp_path,
        config={"eos_token": "<|endoftext|>"},
        extra_files={
            "special_tokens_map.json": json.dumps(
                {
                    "eos_token": {"content": "<|im_end|>", "lstrip": False, "rstrip": False},
                    "additional_special_tokens": ["<|im_start|>", "<tool>"],
                }
            )
        },
    )
    ours, ref = _pair(path)
    assert ours.special_tokens.eos == ref.eos_token == "<|im_end|>"
    assert ours.special_tokens.extra == ("<|im_start|>", "<tool>")
    assert ours.encode("a<tool>b") == ref.encode("a<tool>b")

    tokens = SpecialTokens.from_configs(
        {"eos_token": "<|endoftext|>", "added_tokens_decoder": {}}, {"eos_token": "<|im_end|>"}
    )
    assert tokens.eos == "<|endoftext|>"


def test_model_specific_tokens_reach_the_template(tmp_path: Path) -> None:
    tokens = SpecialTokens.from_configs(
        {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "image_token": "<|image|>",
            "add_bos_token": True,  # a flag, not a token
            "extra_special_tokens": {"audio_token": {"content": "<|audio|>"}},
        },
        None,
    )
    assert tokens.template_vars() == {
        "eos_token": "<|im_end|>",
        "image_token": "<|image|>",
        "audio_token": "<|audio|>",
    }


def test_missing_or_broken_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_artifact(DirTexts(tmp_path))
    message = str(info.value)
    assert "tokenizer.json" in message and str(tmp_path) in message and "\n" not in message

    (tmp_path / "tokenizer.json").write_text('{"model": 3}', encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json .* could not be loaded"):
        Tokenizer.from_artifact(DirTexts(tmp_path))

    write_model_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json .* JSON object"):
        Tokenizer.from_artifact(DirTexts(tmp_path))
