"""Issue 13 item 17: `--kv-capacity auto` on a CPU must leave the machine usable.

Before: auto gave the KV pool all of `MemAvailable` less weights, workspace and 3%, so
the 4 MiB built-in model took 21 GiB of a 24 GiB shared box (44 s to zero it). Now, on
host RAM, auto sizes for `--max-context x --max-concurrency` at most and
`CPU_AUTO_POOL_FRACTION` of the available memory (never below one context), says why, and
the plan counts the CPU runtime's kernel caches.
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.builtin_model import CONFIG
from ninfer_core.cli.main import main
from ninfer_core.device import GIB, probe_device
from ninfer_core.memory import DeviceMemory, device_memory, estimate_workspace, plan_memory
from ninfer_core.memory.planner import (
    CPU_AUTO_POOL_FRACTION,
    KERNEL_CACHE_BYTES_PER_SHAPE,
    MIB,
    AutoCapacityTooSmallError,
)
from ninfer_core.memory.table import render_table
from ninfer_core.model.config import ModelConfig
from ninfer_core.plugin_host import create_host

MODEL = ModelConfig.from_hf(CONFIG, qk_norm=True)
PER_TOKEN = 4 * 4 * 32 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16 bytes


@pytest.fixture(scope="module")
def codec():
    return create_host().kv_codecs.get("bf16")


def plan(codec, free: int, *, host_ram: bool = True, context: int = 4096, concurrency: int = 2):
    memory = DeviceMemory("test", 24 * GIB, free, "MemAvailable", host_ram=host_ram)
    ws = estimate_workspace(MODEL, dtype=torch.bfloat16, kv_codec=codec, prefill_chunk=1024,
                            context=context, concurrency=concurrency)  # fmt: skip
    return plan_memory(
        MODEL, weights_bytes=4 * MIB, codec=codec, memory=memory, workspace=ws,
        max_context=context, max_concurrency=concurrency, kv_capacity="auto",
    )  # fmt: skip


def test_auto_on_a_shared_box_sizes_for_context_times_concurrency(codec):
    """The issue's case: 21 GiB available. Old code: a pool of ~10 million tokens."""
    p = plan(codec, 21 * GIB)
    assert p.pool_tokens == 4096 * 2
    assert p.pool_bytes == 8192 * PER_TOKEN  # 16 MiB, not 20 GiB
    assert "--max-context 4096 x --max-concurrency 2" in p.auto_reason
    assert "auto on the CPU: --max-context 4096 x --max-concurrency 2" in render_table(p)


def test_auto_on_a_cpu_takes_at_most_a_fraction_of_available_memory(codec):
    """32k x 8 sequences would want 512 MiB; a quarter of 1 GiB is 256 MiB."""
    p = plan(codec, 1 * GIB, context=32768, concurrency=8)
    assert p.pool_bytes <= CPU_AUTO_POOL_FRACTION * GIB < 32768 * 8 * PER_TOKEN
    assert p.pool_bytes > CPU_AUTO_POOL_FRACTION * GIB - 16 * PER_TOKEN  # whole pages
    assert "25% of the 1.00 GiB available" in p.auto_reason


def test_auto_on_a_cpu_keeps_one_context_when_the_fraction_is_less(codec):
    p = plan(codec, 15 * GIB // 4, context=524288)  # one context: 1 GiB; a quarter: 0.94
    assert p.pool_tokens == 524288
    assert "one --max-context" in p.auto_reason
    with pytest.raises(AutoCapacityTooSmallError):
        plan(codec, 3 * GIB, context=524288)  # 2 GiB workspace: no room, the old error


def test_auto_on_a_gpu_still_takes_what_is_left(codec):
    p = plan(codec, 21 * GIB, host_ram=False)
    assert p.pool_tokens == p.largest_fit_tokens > 1_000_000
    assert p.auto_reason == "" and p.runtime_bytes == 0


def test_cpu_plan_counts_the_kernel_caches(codec, monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "128")
    p = plan(codec, 21 * GIB)
    assert p.runtime_bytes == 128 * KERNEL_CACHE_BYTES_PER_SHAPE
    assert p.used_bytes == p.weights_bytes + p.pool_bytes + p.workspace.nbytes + p.runtime_bytes
    assert "CPU runtime caches" in render_table(p)
    assert device_memory(probe_device(use_cuda=False)).host_ram


def test_plan_cli_says_what_auto_chose(capsys):
    args = ["plan", "--kv-capacity", "auto", "--max-context", "1024", "--max-concurrency", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "3072 tokens" in out
    assert "auto on the CPU: --max-context 1024 x --max-concurrency 3" in out
