"""GGUF weights kept in their ggml blocks, on a tiny synthetic Llama written like llama.cpp's
converter writes one (tests/test_gguf_reader.py's `write_gguf`): Q4_0, Q4_1 and Q8_0 matrices
load as our Q4G32, Q4G32M and W8G32 (value for value, Q/K rows un-permuted), a fused group
whose parts differ in type is held in one format of the same values (or dense, where a part
is a type we do not keep) instead of failing, fp32 gives the dequantized path's
logits, bf16 runs the int4 kernel, `ninfer plan` sizes the weights the load holds, `ninfer
convert` keeps the codes, and `ninfer bench gguf` runs (llama.cpp faked).
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package (a main dependency) is missing")
pytest.importorskip("transformers", reason="transformers (the reference) needs ninfer[dev]")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")

from test_gguf_reader import reference, tiny_llama, write_gguf  # noqa: E402

import ninfer_core.bench.gguf as bench_gguf  # noqa: E402
import ninfer_plugins.artifact_gguf.artifact as gguf_artifact  # noqa: E402
from ninfer_core.cli.main import main  # noqa: E402
from ninfer_core.config import RuntimeConfig  # noqa: E402
from ninfer_core.device import probe_device  # noqa: E402
from ninfer_core.engine import RuntimeSpec, Sequence, build_runtime  # noqa: E402
from ninfer_core.loading import load_model, open_artifact  # noqa: E402
from ninfer_core.plugin_host import create_host  # noqa: E402
from ninfer_core.quant.tensor import QuantizedTensor  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
Q = gguf.GGMLQuantizationType

#: Layer 0: every fused group uniform (kept); layer 1: q|k|v mixed (held as W8G32), gate|up
#: beside an F16 up (dense), a Q5_1 down (Q5G32M); layer 2: an MXFP4 down (dequantized).
#: The untied head is Q8_0.
TYPES = {
    "token_embd.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q4_0,
    "blk.0.attn_k.weight": Q.Q4_0,
    "blk.0.attn_v.weight": Q.Q4_0,
    "blk.0.attn_output.weight": Q.Q8_0,
    "blk.0.ffn_gate.weight": Q.Q4_1,
    "blk.0.ffn_up.weight": Q.Q4_1,
    "blk.0.ffn_down.weight": Q.Q4_1,
    "blk.1.attn_q.weight": Q.Q4_0,
    "blk.1.attn_k.weight": Q.Q4_0,
    "blk.1.attn_v.weight": Q.Q8_0,
    "blk.1.ffn_gate.weight": Q.Q4_1,
    "blk.1.ffn_up.weight": Q.F16,
    "blk.1.ffn_down.weight": Q.Q5_1,
    "blk.2.ffn_down.weight": Q.MXFP4,
    "output.weight": Q.Q8_0,
}
L0, L1 = "model.layers.0.", "model.layers.1."
KEPT = {
    "model.embed_tokens.weight": "W8G32",
    "lm_head.weight": "W8G32",
    L0 + "self_attn.q_proj.weight": "Q4G32",
    L0 + "self_attn.k_proj.weight": "Q4G32",
    L0 + "self_attn.v_proj.weight": "Q4G32",
    L0 + "self_attn.o_proj.weight": "W8G32",
    L0 + "mlp.gate_proj.weight": "Q4G32M",
    L0 + "mlp.up_proj.weight": "Q4G32M",
    L0 + "mlp.down_proj.weight": "Q4G32M",
    L1 + "self_attn.q_proj.weight": "W8G32",  # Q4_0, widened beside ...
    L1 + "self_attn.k_proj.weight": "W8G32",
    L1 + "self_attn.v_proj.weight": "W8G32",  # ... a Q8_0 v
    L1 + "mlp.down_proj.weight": "Q5G32M",  # Q5_1
}
IDS = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("q") / "tiny.gguf", "llama", tiny_llama(300),
                      types=TYPES)  # fmt: skip


def load(path, dtype: str, *, dense: bool = False):
    """The model from the GGUF; `dense`: every tensor dequantized (the path before blocks
    were kept), by keeping none."""
    host, device = create_host(), probe_device(use_cuda=False)
    with pytest.MonkeyPatch.context() as mp:
        if dense:
            mp.setattr(gguf_artifact, "_kept_formats", lambda named: {})
        loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype=dtype))
    return loaded, host, device


def logits(loaded, host, device, ids=IDS) -> torch.Tensor:
    """All positions' logits [T, vocab]: a prefill of all but 8 tokens, then 8 decode steps."""
    runner = build_runtime(loaded, host, device, RuntimeSpec.for_tokens(256)).runner
    seq = Sequence(ids)
    head = runner.run([(seq, len(ids) - 8)], all_tokens=True)
    return torch.cat([head, *(runner.run([(seq, 1)]) for _ in range(8))])


def test_formats_kept_and_dense_by_group(path):
    art = open_artifact(create_host(), path)
    for name in art.tensor_names():
        fmt = art.tensor_format(name)
        dense = "fp16" if name == L1 + "mlp.up_proj.weight" else "fp32"  # F16 as stored
        assert fmt == KEPT.get(name, dense), name
        weight = art.load_weight(name)
        assert isinstance(weight, QuantizedTensor) == (name in KEPT), name
        if name in KEPT:
            assert weight.fmt.name == fmt
            # the same values as the dequantized path, q/k rows un-permuted alike
            assert torch.equal(weight.dequantize(), art.load_tensor(name)), name
    # a mixed group: q, k in Q4_0 beside a Q8_0 v are all held as W8G32 (the same values,
    # checked above); gate (Q4_1) beside an F16 up, a dense type, loads dense
    records = {r.name: r.format for r in art.object_table()}
    assert records[L1 + "self_attn.q_proj.weight"] == "Q4_0"
    assert records[L1 + "mlp.gate_proj.weight"] == "Q4_1"
    assert art.load_weight(L1 + "mlp.gate_proj.weight").dtype == torch.float32


def test_fp32_logits_equal_the_dequantized_path_and_transformers(path):
    kept = load(path, "fp32")
    model = kept[0].model
    assert isinstance(model.embed_tokens, QuantizedTensor)  # a lookup: rows dequantized
    # fp32 compute: Q4/Q8 projections dequantized once at load (the mixed group too)
    for layer in model.layers[:2]:
        assert isinstance(layer.self_attn.qkv_proj, torch.Tensor)
        assert layer.self_attn.qkv_proj.dtype == torch.float32
    got, dense = logits(*kept), logits(*load(path, "fp32", dense=True))
    assert (got - dense).abs().max().item() <= 1e-5
    with torch.no_grad():
        want = reference(path)(torch.tensor([IDS])).logits[0]
    assert (got - want).abs().max().item() <= 1e-4


def test_bf16_runs_packed_quantized_weights_close_to_fp32(path):
    loaded, host, device = load(path, "bf16")
    model = loaded.model
    # packed for the int4 kernel by the backend, not a dense copy
    assert not isinstance(model.layers[0].self_attn.qkv_proj, torch.Tensor | QuantizedTensor)
    assert not isinstance(model.packed_head, torch.Tensor | QuantizedTensor)
    got = logits(loaded, host, device)
    want = logits(*load(path, "fp32"))
    rel = ((got - want).norm() / want.norm()).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel < 0.03 and top1 >= 0.9, (rel, top1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_plan_sizes_the_weights_the_load_holds(path, dtype, capsys):
    assert main(["plan", str(path), "--dtype", dtype, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["weights_bytes"]
    assert planned == load(path, dtype)[0].model.weight_bytes()


def test_convert_keeps_the_codes_and_the_logits(path, tmp_path, capsys):
    out = tmp_path / "tiny.ninfer"
    assert main(["convert", str(path), str(out), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    src, packed = open_artifact(create_host(), path), open_artifact(create_host(), out)
    for name in src.tensor_names():
        fmt = packed.tensor_format(name)
        if name in KEPT:  # the recipe (mixed) would re-quantize: the blocks stay instead
            assert fmt == KEPT[name], name
            assert torch.equal(packed.load_weight(name).to_stored(),
                               src.load_weight(name).to_stored()), name  # fmt: skip
        elif len(src.tensor_shape(name)) == 2:  # dense in the GGUF's load: the recipe's
            assert fmt in ("Q4G64", "Q5G64", "Q6G64"), (name, fmt)
    assert {"Q4G32", "Q4G32M", "W8G32"} <= set(summary["by_format"])
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "Q4G32M" in shown and "W8G32" in shown
    ours = logits(*load(out, "fp32"))  # it runs (the GGUF's logits: tests/test_gguf_real_model.py)
    assert ours.shape == (len(IDS), 300) and bool(ours.isfinite().all())


def _fake_llama_cpp(calls: list) -> types.ModuleType:
    """A stand-in for llama-cpp-python: `Llama(...).generate` yields ids one by one."""

    class Llama:
        def __init__(self, **kwargs):
            calls.append(kwargs)

        def reset(self):
            pass

        def generate(self, tokens, **kwargs):
            calls.append(kwargs)
            n = 0
            while True:
                n += 1
                yield 7 + n

        def close(self):
            pass

    module = types.ModuleType("llama_cpp")
    module.Llama = Llama
    module.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    return module


def test_bench_gguf_rows_and_the_llama_cpp_peer(path, monkeypatch, capsys):
    args = ["bench", "gguf", str(path), "--prompt-tokens", "24", "--new", "4", "--threads", "1"]
    calls: list = []
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_llama_cpp(calls))
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    kept, base, peer = result["rows"]
    assert kept["weights"].startswith("GGUF kept quantized") and base["decode_vs_bf16"] == 1.0
    assert peer["engine"] == "llama.cpp" and 0 <= peer["greedy_ids_agree_with_bf16"] <= 4
    assert calls[0]["model_path"] == str(path) and calls[0]["n_threads"] == 1
    assert calls[1]["top_k"] == 1  # greedy
    assert result["prompt_tokens"] == 24 and len(result["load_average"]) == 2
    monkeypatch.setattr(bench_gguf, "llama_cpp_installed", lambda: False)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| ninfer | bf16 conversion (baseline) |" in out
    assert "llama.cpp: not installed: pip install llama-cpp-python" in out
