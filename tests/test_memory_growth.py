"""Issue 13 item 5: RSS must not grow with every new context length.

The cause: on the CPU, oneDNN compiles and caches one bf16 matmul kernel (~1 MiB) per
shape, and decode attention had a new shape every step (one more key). Measured before the
fix (`ninfer bench memory`, built-in model, bf16): +945 MiB over one 1,500-token
generation, +130 MiB over 50 prompts of distinct lengths. The fix has three parts, each
tested here: decode attention pads its context to `decode_length` (few shapes), the entry
points cap the kernel caches (`CPU_RUNTIME_ENV`), which the plan charges for, and the model
runner gives freed heap pages back before prefill steps (`HeapTrimmer`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.sequence import Sequence
from ninfer_core.memory.heap import HeapTrimmer
from ninfer_core.memory.planner import MIB
from ninfer_core.model.ops import decode_length, decode_length_count
from ninfer_core.sampling import SamplingParams
from ninfer_plugins.backend_torch import _decode_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("block_size", [1, 16, 24])
def test_decode_length_pads_at_most_an_eighth_or_a_page(block_size):
    lengths = set()
    for ctx in range(1, 5000):
        padded = decode_length(ctx, block_size)
        assert padded >= ctx and padded % block_size == 0
        assert padded - ctx < max(block_size, ctx / 8 + 1e-9)
        lengths.add(padded)
    assert len(lengths) == decode_length_count(4999, block_size)
    assert decode_length_count(4096, 16) == 48 and decode_length_count(131072, 16) == 88


def test_padded_keys_change_nothing():
    """Keys past `valid` get probability 0: the output is the unpadded one."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 32, generator=g)
    k, v = torch.randn(4, 80, 32, generator=g), torch.randn(4, 80, 32, generator=g)
    padded = _decode_rows(q, k, v, 0.2, valid=71)
    exact = _decode_rows(q, k[:, :71].contiguous(), v[:, :71].contiguous(), 0.2, valid=71)
    torch.testing.assert_close(padded, exact, rtol=1e-6, atol=1e-6)


class KeyLengths(TorchDispatchMode):
    """Records the key count of every batched matmul (decode attention's q·kᵀ)."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        batched = func in (torch.ops.aten.matmul.default, torch.ops.aten.bmm.default)
        if batched and args[1].dim() == 3:  # [Hkv, D, L] for q·kᵀ, [Hkv, L, D] for p·v
            self.lengths.add(args[1].shape[-1])
        return func(*args, **(kwargs or {}))


def test_decode_attention_sees_few_shapes(engine_model):
    """Fails on the old code: 300 decode steps gave 300 key lengths (one kernel each)."""
    loaded, host, device = engine_model
    engine = Engine(loaded, EngineConfig(max_context=512, max_concurrency=1), host=host,
                    device=device)  # fmt: skip
    request = GenerationRequest(list(range(10, 26)), SamplingParams(temperature=0.0),
                                max_tokens=300, ignore_eos=True)  # fmt: skip
    with KeyLengths() as seen:
        engine.generate([request])
    engine.close()
    assert 2 <= len(seen.lengths) <= decode_length_count(316, 16) + 1  # + p·v's head dim


@pytest.mark.slow
def test_rss_stays_bounded_through_the_entry_point():
    """`ninfer bench memory` in a fresh process, through the real entry point (which sets
    the kernel cache capacity before torch loads): 600 unseen decode lengths and 40 prompt
    lengths after warm-up must grow RSS by less than the plan's CPU runtime term plus the
    KV pool and 32 MiB of slack (225 MiB). Measured: before the fix (no padding, caches
    at their default 1024) the same run grew by 746 MiB; after, by 77-83 MiB."""
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY",
           "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}  # fmt: skip
    cmd = [sys.executable, "-m", "ninfer_core.cli.main", "bench", "memory", "--json",
           "--new", "500", "--unseen-steps", "100", "--prefills", "40"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout)
    bound = result["planned_runtime_bytes"] + result["kv_pool_bytes"] + 32 * MIB
    assert result["planned_runtime_bytes"] == 128 * int(1.5 * MIB)  # the capacity was set
    assert result["growth_after_warmup"] < bound, json.dumps(result["phases"])


def test_heap_trimmer_trims_at_most_once_per_interval():
    now, calls = [0.0], []
    trimmer = HeapTrimmer(5.0, clock=lambda: now[0], trim=calls.append)
    assert not trimmer.maybe_trim()  # no time has passed since it was made
    now[0] = 5.0
    assert trimmer.maybe_trim() and calls == [0]
    now[0] = 9.9
    assert not trimmer.maybe_trim()
    now[0] = 10.0
    assert trimmer.maybe_trim() and trimmer.trims == 2


def test_cpu_prefill_steps_trim_the_heap(engine_model):
    """Fails on the old code, which never gave freed heap pages back (see heap.py)."""
    loaded, host, device = engine_model
    runner = build_runtime(loaded, host, device, RuntimeSpec.for_tokens(64)).runner
    assert isinstance(runner.heap, HeapTrimmer) and runner.heap._trim is not None
    calls = []
    runner.heap = HeapTrimmer(0.0, trim=calls.append)
    seq = _seq(40, 0)
    seq.block_table = []  # the runner allocates the pages
    runner.run([(seq, 40)])
    seq.append_token(1)
    runner.run([(seq, 1)])  # decode steps build nothing new: no trim
    assert calls == [0]


def _seq(n: int, computed: int) -> Sequence:
    seq = Sequence(list(range(n)))
    seq.num_computed_tokens = computed
    seq.block_table = list(range(-(-n // 16)))
    return seq
