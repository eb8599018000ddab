"""The workspace estimate of a hybrid model bounds what a real step allocates.

A tiny Qwen3.5 (3 Gated DeltaNet layers, 1 gated attention layer) runs the plan's worst
step (a prefill chunk and a decode row, both sequences at the context) while every
storage the ops create is counted (`LiveBytes`, tests/test_memory_plan.py). At a short
context the DeltaNet layers' per-chunk temporaries set the peak, which an estimate
that models only attention misses; at a long one the attention layer's gathered K/V
does. The estimate with the family's caches covers both without overshooting by much.
"""

from __future__ import annotations

import pytest
import torch
from test_hybrid_qwen3_5 import write_tiny_qwen3_5
from test_memory_plan import LiveBytes, _tensors

from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.loading import load_model
from ninfer_core.memory.workspace import (
    estimate_workspace,
    measure_workspace,
    profiling_runtime,
    run_profiling_step,
)
from ninfer_core.model.caches import caches_for
from ninfer_core.plugin_host import create_host

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK, CONCURRENCY = 256, 2


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5-workspace")
    write_tiny_qwen3_5(path, "dense")
    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype="bf16"))
    return loaded, host, device


def measured_peak(hybrid, context: int) -> tuple[int, object]:
    """Peak live bytes of the worst step at `context`, and the runner it ran in."""
    loaded, host, device = hybrid
    runtime = profiling_runtime(
        loaded, host, device, kv_dtype="rk8v4", block_size=16, prefill_chunk=CHUNK,
        concurrency=CONCURRENCY,
    )  # fmt: skip
    store, runner = runtime.kv_store, runtime.runner
    known = [*_tensors(store, *loaded.model.modules()), *loaded.model.parameters()]
    known += [b for bufs in runner.states.buffers.values() for b in bufs]
    with LiveBytes(known) as mode:
        logits = run_profiling_step(runner, CHUNK, context, CONCURRENCY)
    assert logits.shape == (CONCURRENCY, loaded.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert runner.states.allocate() == 0  # the step handed its slots back
    return mode.peak, runner


@pytest.mark.parametrize("context", [CHUNK, 16384])
def test_the_estimate_bounds_a_real_step(hybrid, context):
    loaded, host, _ = hybrid
    peak, runner = measured_peak(hybrid, context)
    caches = caches_for(loaded.family, loaded.config)
    kw = dict(dtype=torch.bfloat16, kv_codec=host.kv_codecs.get("rk8v4"), prefill_chunk=CHUNK,
              context=context, concurrency=CONCURRENCY)  # fmt: skip
    estimate = estimate_workspace(loaded.config, caches=caches, **kw)
    # At the long context the attention term's own margin sets the slack: the gathered
    # K/V's codec scratch, generous for this model's 16-wide heads (1.14x at 256-wide
    # ones, a Qwen3.6-27B's, measured at 184320 tokens).
    slack = 1.5 if context == CHUNK else 2.0
    assert peak <= estimate.nbytes <= slack * peak, (peak, estimate.parts)
    cpu = measure_workspace(runner, CHUNK, context=context, concurrency=CONCURRENCY, caches=caches)
    assert cpu == estimate
    attention_only = estimate_workspace(loaded.config, **kw)
    linear = estimate.parts["linear_attention"]
    if context == CHUNK:  # the DeltaNet's stage sets the peak; attention alone falls short
        assert max(estimate.parts.values()) == linear
        assert attention_only.nbytes < peak
    else:  # the attention layer's K/V, which grow with the context, set it
        assert max(estimate.parts.values()) == estimate.parts["attention"] > linear
        assert attention_only == estimate_workspace(loaded.config, caches=None, **kw)
