"""Memory bandwidth, and the decode ceiling it sets.

Decoding one token at batch 1 reads every weight matrix once and the whole KV cache once,
and does ~2 FLOPs per weight byte: on a CPU it is bound by memory, so
bandwidth ÷ bytes read per token is the most tokens per second any engine can reach.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def measure_read_gbs(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: best of `repeats` sums over a `size_bytes` fp32 tensor.

    Uses torch's current thread count, so call it after `torch.set_num_threads`. The
    tensor is far larger than any cache, and the best run is the least disturbed by
    whatever else the machine is doing. It is read from pages like the engine's weights
    (2 MiB where `memory.huge_pages` gets them), so the ceiling compares like with like.
    """
    from ninfer_core.memory import huge_pages

    x = torch.ones(size_bytes // 4, dtype=torch.float32)  # ones, not empty: pages are touched
    huge_pages.collapse([x])
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    del x
    return size_bytes / best / 1e9


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode token reads: weights (all matrices, the head in full) and KV."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv

    def ceiling_tok_s(self, gbs: float) -> float:
        return gbs * 1e9 / self.total


def decode_bytes(
    config: Mapping[str, Any], weight_bytes: int, kv_bytes: int, context_len: float
) -> DecodeBytes:
    """Bytes read per decode token of a dense decoder, from its HF `config.json`.

    `weight_bytes`/`kv_bytes`: bytes per value. `context_len`: cached tokens each step
    attends over (on average). The embedding lookup reads one row, which is left out;
    the head matrix (tied or not) is read in full. Biases are left out too: they are
    a few KiB against hundreds of MiB.
    """
    h, i = config["hidden_size"], config["intermediate_size"]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    q, kv = heads * d, kv_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i  # qkv, o, gate, up, down
    norms = 2 * h + (2 * d if config.get("model_type") == "qwen3" else 0)
    values = layers * (per_layer + norms) + h + config["vocab_size"] * h
    kv_per_token = 2 * layers * kv_heads * d * kv_bytes
    return DecodeBytes(weights=values * weight_bytes, kv=round(kv_per_token * context_len))


#: The embedding table and the separate head, by their Hugging Face names.
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def artifact_weight_bytes(path: Path, dtype: torch.dtype) -> int | None:
    """Bytes of weights a decode token reads from a `.ninfer` model computed in `dtype` on
    the CPU, or None for a model with no quantized tensor (`decode_bytes` counts those).

    Each matrix counts what the torch backend holds for it (`TorchOps.packed_nbytes`: the
    codes its bf16 kernels read, a matrix dequantized once at load in other dtypes), or
    its stored bytes where it is kept as loaded; any other tensor is held in `dtype`. The
    embedding table is left out when a separate head exists (the lookup reads one row);
    a tied head is the table, read in full."""
    from ninfer_core.kernels.reference import TorchOps
    from ninfer_core.loading import open_artifact
    from ninfer_core.plugin_host import create_host
    from ninfer_core.quant.formats import weight_format

    artifact = open_artifact(create_host(), path)
    if artifact.tensor_format is None:
        return None
    ops = TorchOps("cpu")
    names = artifact.tensor_names()
    if _HEAD in names:
        names = [n for n in names if n != _EMBED]
    total, quantized = 0, False
    for name in names:
        shape = tuple(int(d) for d in artifact.tensor_shape(name))
        fmt_name = artifact.tensor_format(name)
        fmt = weight_format(fmt_name)
        quantized |= fmt.quantized
        held = ops.packed_nbytes(fmt_name, shape, dtype=dtype) if len(shape) == 2 else None
        if held is None:
            held = fmt.stored_nbytes(shape) if fmt.quantized else math.prod(shape) * dtype.itemsize
        total += held
    return total if quantized else None
