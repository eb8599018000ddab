"""The Triton backend end to end: chosen by the host, composed per op, and running a
quantized model's prefill and decode through the engine as the torch reference does.

Under Triton's interpreter on this CPU (`TRITON_INTERPRET=1`, which makes the backend
answer yes on a machine without a GPU), in fp32: the kernels then compute what the
reference computes up to summation order, so greedy ids must agree exactly and logits
closely.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import prompt_logits, write_tiny_qwen3
from text_fixtures import write_model_dir
from triton_helpers import interpreted_module

from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import convert
from ninfer_core.device import probe_device
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams

#: What the backend serves here; the Gated DeltaNet ops stay with the reference.
SERVED = {"linear", "attention", "rms_norm", "rope", "silu_and_mul"}
PROMPT = [5, 17, 201, 44, 9, 120, 87, 3, 250, 61, 12, 199, 7, 33, 140, 2, 76, 210, 28]


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    # Import the kernel modules interpreted before the host loads them.
    interpreted_module("ninfer_plugins.backend_triton.ops")
    root = tmp_path_factory.mktemp("triton-e2e")
    out = root / "tiny-q4.ninfer"
    folder = write_tiny_qwen3(root / "hf", hidden_size=64, intermediate_size=128,
                              vocab_size=512)  # fmt: skip
    write_model_dir(folder)  # a tokenizer (400 ids) beside the weights
    convert(folder, out, recipe_name="q4")
    return out


def load(path, backend: str, kv: str):
    host = create_host()
    runtime = RuntimeConfig(dtype="fp32", gemm_backend=backend, kv_dtype=kv)
    return load_model(path, host=host, device=probe_device(), runtime=runtime), host


def greedy(loaded, host, kv: str, new: int = 6) -> list[int]:
    engine = Engine(loaded, EngineConfig(kv_capacity=256), host=host, device=probe_device(),
                    kv_dtype=kv)  # fmt: skip
    request = GenerationRequest(PROMPT, SamplingParams(temperature=0.0), max_tokens=new,
                                ignore_eos=True)  # fmt: skip
    (result,) = engine.generate([request])
    return result.token_ids


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_a_quantized_model_runs_on_the_triton_kernels_as_the_reference_does(
    q4_model, kv, monkeypatch
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ours, host = load(q4_model, "auto", kv)
    chosen = {c.op: c.backend for c in ours.kernels}
    assert {op for op, b in chosen.items() if b == "triton"} == SERVED, chosen
    assert type(ours.model.ops).__name__ != "TorchOps"
    got, got_ids = prompt_logits(ours, PROMPT), greedy(ours, host, kv)
    monkeypatch.delenv("TRITON_INTERPRET")
    ref, ref_host = load(q4_model, "torch", kv)
    assert all(c.backend == "torch" for c in ref.kernels)
    want = prompt_logits(ref, PROMPT)
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-5, f"prefill logits rel. error {rel:.2e}"
    assert got_ids == greedy(ref, ref_host, kv)


def test_without_a_gpu_or_the_interpreter_the_reference_serves_every_op(q4_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    loaded, _ = load(q4_model, "auto", "fp32")
    linear = next(c for c in loaded.kernels if c.op == "linear")
    assert linear.backend == "torch"
    assert any(name == "triton" and "no CUDA device" in why for name, why in linear.passed_over)
    assert torch.isfinite(prompt_logits(loaded, PROMPT[:5])).all()
