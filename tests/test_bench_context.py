"""`ninfer bench context` on its tiny models and short contexts: the two random models
load as the families they are meant for, both produce every token at every context, and
the report has its structure. No figure is asserted: speed belongs to the machine."""

from __future__ import annotations

import json

import pytest

from ninfer_core.bench import context_models
from ninfer_core.bench.context import ContextBenchConfig, render, run_bench
from ninfer_core.cli.main import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXTS = [16, 40, 72]
NEW = 3


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-context")
    cfg = ContextBenchConfig(
        contexts="72,16,40", size="tiny", new=NEW, threads=1, dtype="fp32", out=str(out)
    )
    return run_bench(cfg)


def test_both_models_load_as_their_families(result):
    hybrid, dense = result["models"]["hybrid"], result["models"]["dense"]
    assert (hybrid["family"], hybrid["architecture"]) == ("qwen3-next", "Qwen3NextForCausalLM")
    assert (dense["family"], dense["architecture"]) == ("qwen3", "Qwen3ForCausalLM")
    assert (hybrid["layers"], hybrid["full_attention_layers"]) == (4, 1)
    assert (dense["layers"], dense["full_attention_layers"]) == (4, 4)
    # Of about the same size, and the hybrid caches a quarter of the KV a token plus a
    # fixed state.
    assert 0.7 < hybrid["parameters"] / dense["parameters"] < 1.4
    assert hybrid["kv_bytes_per_token"] * 4 == dense["kv_bytes_per_token"]
    assert hybrid["state_bytes_per_sequence"] > 0 == dense["state_bytes_per_sequence"]


def test_every_context_produced_every_token_for_both(result):
    assert [r["context"] for r in result["rows"]] == CONTEXTS
    for row in result["rows"]:
        for name in ("hybrid", "dense"):
            point = row[name]
            assert point["tokens"] == NEW
            assert point["prefill_tok_s"] > 0 and point["decode_tok_s"] > 0
            assert point["decode_vs_shortest"] is not None
        assert (
            row["prefill_ratio"] == row["hybrid"]["prefill_tok_s"] / row["dense"]["prefill_tok_s"]
        )
        assert row["decode_ratio"] == row["hybrid"]["decode_tok_s"] / row["dense"]["decode_tok_s"]
    first = result["rows"][0]
    assert first["hybrid"]["decode_vs_shortest"] == first["dense"]["decode_vs_shortest"] == 1.0


def test_the_report_is_one_table_with_a_row_per_context(result):
    text = render(result)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 1 + len(CONTEXTS)  # header, separator, contexts
    assert "decode hybrid/dense" in rows[0] and "hybrid vs 16" in rows[0]
    assert "family qwen3-next" in text and "family qwen3" in text
    json.dumps(result)  # --json prints it as it is


def test_the_models_are_built_once_and_reused(tmp_path):
    first = context_models.ensure_models("tiny", tmp_path)
    stamps = {name: (p / "model.safetensors").stat().st_mtime_ns for name, p in first.items()}
    again = context_models.ensure_models("tiny", tmp_path)
    assert again == first
    assert {n: (p / "model.safetensors").stat().st_mtime_ns for n, p in again.items()} == stamps
    (tmp_path / "hybrid-tiny" / "notes.txt").write_text("mine")
    (first["hybrid"] / "config.json").write_text("{}")
    with pytest.raises(Exception, match="not a benchmark model"):
        context_models.ensure_models("tiny", tmp_path)


def test_a_model_whose_config_does_not_parse_is_written_again(tmp_path):
    first = context_models.ensure_models("tiny", tmp_path)
    (first["dense"] / "config.json").write_text("{not json")
    again = context_models.ensure_models("tiny", tmp_path)
    written = json.loads((again["dense"] / "config.json").read_text())
    assert written == context_models.dense_config(context_models.SIZES["tiny"])


@pytest.mark.parametrize(
    "args",
    [
        ["--contexts", "1024,x"],
        ["--contexts", "0"],
        ["--contexts", "1024,200000"],
        ["--new", "1"],
        ["--size", "huge"],
    ],
)
def test_bad_options_fail_before_anything_is_built(args, tmp_path, capsys):
    try:
        code = main(["bench", "context", "--out", str(tmp_path), *args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code not in (0, None)
    assert "error" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_command_prints_json_and_progress(tmp_path, capsys):
    argv = ["bench", "context", "--size", "tiny", "--contexts", "8,24", "--new", "2",
            "--threads", "1", "--dtype", "fp32", "--out", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert [r["context"] for r in result["rows"]] == [8, 24]
    assert all(r[name]["tokens"] == 2 for r in result["rows"] for name in ("hybrid", "dense"))
    assert "hybrid at 24" in captured.err and "dense at 24" in captured.err
