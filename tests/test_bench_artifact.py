"""`ninfer bench artifact` on a tiny checkpoint: the table's structure and its ratios.

Timings are whatever this machine gives; the tests check only that every figure is
there and that each ratio is the quotient of two figures measured in the same run.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch
from checkpoints import write_tiny_qwen3
from text_fixtures import write_model_dir

from ninfer_core.bench.artifact import add_ratios, peak_rss_bytes, render
from ninfer_core.cli.main import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = write_tiny_qwen3(
        tmp_path_factory.mktemp("hf") / "tiny", dtype=torch.bfloat16, vocab_size=512
    )  # the fixture tokenizer has up to 400 ids
    write_model_dir(path)
    args = ["bench", "artifact", str(path), "--recipes", "bf16,q4", "--new", "3",
            "--prompt-tokens", "8", "--threads", "1", "--json"]  # fmt: skip
    out = io.StringIO()  # capsys is per test; the run is shared by the module
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return json.loads(out.getvalue())


def test_every_source_has_load_and_decode_figures(result):
    rows = result["rows"]
    assert [r["source"] for r in rows] == ["hf-folder", "bf16", "q4"]
    assert result["prompt_tokens"] == 8 and result["new_tokens"] == 3
    for r in rows:
        assert r["load_s"] > 0 and r["peak_rss"] > 0 and r["weight_bytes"] > 0
        assert r["file_bytes"] > 0 and r["decode_tok_s"] > 0
    # q4 stores and holds fewer bytes than bf16
    assert rows[2]["file_bytes"] < rows[1]["file_bytes"]
    assert rows[2]["weight_bytes"] < rows[1]["weight_bytes"]


def test_ratios_are_quotients_of_measured_figures(result):
    hf, bf16 = result["rows"][0], result["rows"][1]
    for r in result["rows"]:
        assert r["load_ratio"] == pytest.approx(r["load_s"] / hf["load_s"])
        assert r["rss_ratio"] == pytest.approx(r["peak_rss"] / hf["peak_rss"])
        assert r["decode_ratio"] == pytest.approx(r["decode_tok_s"] / bf16["decode_tok_s"])
        assert r["decode_baseline"] == "bf16"
    assert bf16["decode_ratio"] == 1.0 and hf["load_ratio"] == 1.0


def test_table_has_a_line_per_source(result):
    lines = render(result).splitlines()
    assert "load s" in lines[1] and "decode tok/s" in lines[1]
    assert [line.split()[0] for line in lines[2:5]] == ["hf-folder", "bf16", "q4"]
    assert lines[5].startswith("load and peak RSS × hf-folder; decode × bf16")


def test_decode_falls_back_to_the_folder_without_a_bf16_run():
    rows = [
        {"source": "hf-folder", "load_s": 2.0, "peak_rss": 100, "decode_tok_s": 10.0},
        {"source": "q4", "load_s": 0.5, "peak_rss": 50, "decode_tok_s": 25.0},
    ]
    add_ratios(rows)
    assert (rows[1]["load_ratio"], rows[1]["rss_ratio"], rows[1]["decode_ratio"]) == (
        0.25,
        0.5,
        2.5,
    )
    assert rows[1]["decode_baseline"] == "hf-folder"


def test_a_child_reports_its_own_peak_rss_not_the_parents(tmp_path):
    """Linux keeps `ru_maxrss` across exec, so a child forked from a large process would
    report the parent's peak; each load's figure must be its own."""
    ballast = torch.ones(2**28, dtype=torch.int32)  # 1 GiB, touched
    code = "from ninfer_core.bench.artifact import peak_rss_bytes; print(peak_rss_bytes())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    child = int(done.stdout.strip())
    assert 0 < child < ballast.numel() * ballast.element_size()
    assert peak_rss_bytes() > ballast.numel() * ballast.element_size()
