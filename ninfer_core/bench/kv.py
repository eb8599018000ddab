"""`ninfer bench kv`: decode tok/s over a long cached context, per KV codec, against fp16.

The cache is filled by writing random keys and values straight into the pages (a 32K
prefill would take minutes on a CPU and measure prefill, not the codec); each decode
step then reads the whole context through the codec, which is the cost that differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ninfer_core.config import opt
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.sequence import Sequence


@dataclass
class KVBenchConfig:
    """Contexts and codecs for `ninfer bench kv`."""

    contexts: str = opt("1024,8192,32768", "comma-separated context lengths (tokens)")
    codecs: str = opt("", "comma-separated codecs (default: every one this device supports)")
    steps: int = opt(8, "timed decode steps per point")


def _fill(store: Any, cfg: Any, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    chunk = 4096
    for layer in range(cfg.num_layers):
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            shape = (n, cfg.num_kv_heads, cfg.head_dim)
            k = torch.randn(shape, generator=gen).to(device, dtype)
            v = torch.randn(shape, generator=gen).to(device, dtype)
            store.write(layer, torch.arange(start, start + n, device=device), k, v)


def decode_tok_s(
    loaded: Any, host: Any, device: Any, codec: str, context: int, steps: int
) -> float:
    """Decode steps over `context` cached tokens, their K/V encoded by `codec`."""
    spec = RuntimeSpec.for_tokens(context + steps + 4, 16, kv_dtype=codec)
    runtime = build_runtime(loaded, host, device, spec)
    runner, manager = runtime.runner, runtime.block_manager
    seq = Sequence([1] * (context + 1))
    manager.allocate(seq, context)  # blocks 0.. in order, so slot = position
    _fill(runtime.kv_store, loaded.config, context, loaded.dtype, runner.device)
    seq.num_computed_tokens = context
    runner.run([(seq, 1)])  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        seq.append_token(1)
        runner.run([(seq, 1)])
    elapsed = time.perf_counter() - start
    del runtime, runner
    return steps / elapsed


def bench_kv(loaded: Any, host: Any, device: Any, cfg: KVBenchConfig) -> list[dict[str, Any]]:
    contexts = [int(c) for c in cfg.contexts.split(",") if c]
    names = [n for n in cfg.codecs.split(",") if n] or [
        e.name for e in host.kv_codecs.entries() if e.obj.supports(device).ok
    ]
    mc = loaded.config
    rows = []
    for context in contexts:
        base = None
        for name in ["fp16", *[n for n in names if n != "fp16"]]:
            codec = host.kv_codecs.get(name)
            tok_s = decode_tok_s(loaded, host, device, name, context, cfg.steps)
            base = tok_s if name == "fp16" else base
            rows.append({
                "context": context, "codec": name, "decode_tok_s": tok_s,
                "vs_fp16": tok_s / base if base else 1.0,
                "bytes_per_token": codec.bytes_per_token(mc.num_layers, mc.num_kv_heads,
                                                         mc.head_dim),
            })  # fmt: skip
    return rows
