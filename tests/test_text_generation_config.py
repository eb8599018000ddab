"""generation_config.json gives the stop ids and sampling defaults the model's authors set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from text_fixtures import DirTexts

from ninfer_core.errors import ModelLoadError
from ninfer_core.text import GenerationDefaults, stop_token_ids

QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def _write(path: Path, value: object) -> DirTexts:
    (path / "generation_config.json").write_text(json.dumps(value), encoding="utf-8")
    return DirTexts(path)


def test_reads_qwen3_style_file(tmp_path: Path) -> None:
    defaults = GenerationDefaults.from_artifact(_write(tmp_path, QWEN3_GENERATION_CONFIG))
    assert defaults == GenerationDefaults(
        eos_token_ids=(151645, 151643), temperature=0.6, top_p=0.95, top_k=20, do_sample=True
    )
    assert defaults.repetition_penalty is None and defaults.min_p is None


def test_single_eos_and_integral_floats(tmp_path: Path) -> None:
    raw = {"eos_token_id": 2, "repetition_penalty": 1, "top_k": 50.0, "do_sample": False}
    defaults = GenerationDefaults.from_artifact(_write(tmp_path, raw))
    assert defaults.eos_token_ids == (2,)
    assert defaults.repetition_penalty == 1.0 and isinstance(defaults.repetition_penalty, float)
    assert defaults.top_k == 50 and isinstance(defaults.top_k, int)
    assert defaults.do_sample is False


def test_absent_file_means_no_defaults(tmp_path: Path) -> None:
    assert GenerationDefaults.from_artifact(DirTexts(tmp_path)) == GenerationDefaults()


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"eos_token_id": "2"}, "eos_token_id"),
        ({"eos_token_id": [1, True]}, "eos_token_id"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 2.5}, "top_k"),
        ({"do_sample": 1}, "do_sample"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_values_name_the_file_and_field(tmp_path: Path, raw: object, field: str) -> None:
    with pytest.raises(ModelLoadError, match=rf"generation_config\.json .*{field}"):
        GenerationDefaults.from_artifact(_write(tmp_path, raw))


def test_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json"):
        GenerationDefaults.from_artifact(DirTexts(tmp_path))


def test_stop_ids_combine_all_sources_once() -> None:
    defaults = GenerationDefaults(eos_token_ids=(151645, 151643))
    assert stop_token_ids(defaults, {"eos_token_id": 151645}, 151645) == (151645, 151643)
    assert stop_token_ids(GenerationDefaults(), {"eos_token_id": [2, 32000]}, 7) == (2, 32000, 7)
    assert stop_token_ids(GenerationDefaults(), {"text_config": {"eos_token_id": 1}}) == (1,)
    assert stop_token_ids(GenerationDefaults(), None, None) == ()
    with pytest.raises(ModelLoadError, match=r"config\.json eos_token_id"):
        stop_token_ids(defaults, {"eos_token_id": "x"})
