"""The CPU decode attention of `csrc/cpu_attention.cpp`: query rows over their sequences'
K/V pages, read in place through the block table.

A compiled decode step (`model/decode_graph.py`) used to gather each layer's pages into a
`[B, Hkv, L, D]` copy and sum scores with generated reductions at 6-7 GB/s: at a
512-token context that was a third of SmolLM2's step and a fifth of Qwen3-0.6B's
(docs/performance.md). The operator reads the pool where it lies, scores sixteen keys at
a time (`vdpbf16ps` for bf16 queries over bf16 pages) and keeps its sums in registers.

It is built with the CPU GEMVs (`cpu_gemv.unavailable`: one `ninfer_cpu` library) and
serves float pages of 32-256 wide heads, and coded ones (int8 K, int8 or int4 V, an fp16
scale per group: the `int8` and `rk8v4` stores), whose codes it decodes as it reads
them; `unsupported` says why it doesn't serve a store's pages, and the graph then
attends as before. A rotated store's (rk8v4) query is turned by H before and the output
by Hᵀ after, one vector a row. `NINFER_CPU_ATTENTION=0` turns it off (the A/B switch of
`docs/performance.md`).
"""

from __future__ import annotations

import os

import torch

from ninfer_core.kernels import cpu_gemv
from ninfer_core.kv.pages import KVPages
from ninfer_core.kv.quant import group_size

#: Head dims the operator is compiled for.
HEAD_DIMS = (32, 64, 128, 256)
#: Query heads a KV head may serve.
MAX_GROUP = 16
#: Keys a task of the operator owns (`kChunk`): a row keeps one partial per chunk.
CHUNK = 128


@torch.compiler.assume_constant_result
def kernel_unavailable() -> str | None:
    """Why the operator can't run in this process, or None (a constant of the traced
    graph: decided once, when the graph is captured)."""
    if os.environ.get("NINFER_CPU_ATTENTION", "1") == "0":
        return "NINFER_CPU_ATTENTION=0"
    return cpu_gemv.unavailable()


def unsupported(pages: KVPages, num_heads: int) -> str | None:
    """Why `decode_attention` can't attend over `pages` for `num_heads` query heads, or
    None: it reads float pages (bf16, fp16, fp32) and coded ones (int8 K, int8 or int4
    V, fp16 group scales, with the store's encoder for this step's rows) on the CPU,
    rotated or not."""
    if (reason := kernel_unavailable()) is not None:
        return reason
    values = pages.k.values
    if values.device.type != "cpu":
        return f"the pages are on {values.device.type}"
    if pages.k.encoding == "float" and pages.v.encoding == "float":
        if values.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"pages of {values.dtype}"
    elif (reason := _coded_refusal(pages)) is not None:
        return reason
    if pages.head_dim not in HEAD_DIMS:
        return f"head dim {pages.head_dim} (the operator has {HEAD_DIMS})"
    if num_heads % pages.num_kv_heads or num_heads // pages.num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads over {pages.num_kv_heads} KV heads"
    return None


def _coded_refusal(pages: KVPages) -> str | None:
    """Why the operator can't decode these coded pools, or None."""
    k, v = pages.k, pages.v
    if (k.encoding, k.bits) != ("int", 8) or v.encoding != "int" or v.bits not in (4, 8):
        return (
            f"pages of {k.encoding}{k.bits} K and {v.encoding}{v.bits} V codes "
            "(the operator decodes int8 K, int8 or int4 V)"
        )
    if k.encoder is None or v.encoder is None:
        return "the coded pages name no encoder for this step's own K/V"
    want = group_size(pages.head_dim)
    if k.group != want or v.group != want:
        return f"groups of {k.group} and {v.group} values (the operator has {want})"
    return None


def served_pages(kv_store, layer: int, num_heads: int) -> KVPages | None:
    """Layer `layer`'s pages of `kv_store` where the operator attends over them for
    `num_heads` query heads, else None (the caller gathers them instead)."""
    if kv_store.raw_pages is None:  # an optional member of the KVStore contract
        return None
    pages = kv_store.raw_pages(layer)
    return pages if unsupported(pages, num_heads) is None else None


def serves(kv_store, group: int) -> bool:
    """Whether decode rows over `kv_store`'s pages, `group` query heads a KV head, run the
    operator (`TorchOps.paged_attention`, the compiled step): they then gather nothing,
    which the workspace estimate counts (`memory/workspace.py`)."""
    if kv_store.raw_pages is None:  # an optional member of the KVStore contract
        return False
    pages = kv_store.raw_pages(0)
    return unsupported(pages, group * pages.num_kv_heads) is None


def decode_attention(
    q: torch.Tensor,
    pages: KVPages,
    table: torch.Tensor,
    context: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    width: int,
    scale: float,
) -> torch.Tensor:
    """Each of `B * width` query rows over its sequence's keys, computed in fp32.

    q: [R, H, D], R = B * width, sequence-major; table: [B, P] int64; context: [B]
    int64, row 0's key count (its own key included); k_new, v_new: [R, Hkv, D], this
    step's K/V, read as the store will keep them (cast to the pages' dtype, or coded by
    the pool's encoder after the rotation). Row j of sequence b attends over the
    `context[b] - 1` cached keys, then rows 0..j of its own sequence's new K/V (in the
    order a lone decode finds them in the pool) -> [R, H, D] in q's dtype.
    """
    dtype, rotation = q.dtype, pages.rotation
    if rotation is not None:  # (qH)·(kH) = q·k; the output comes back by Hᵀ
        q, k_new, v_new = (rotation.forward(x) for x in (q, k_new, v_new))  # fp32
    k, v = pages.k, pages.v
    if k.encoding == "float":
        out = torch.ops.ninfer_cpu.decode_attention(
            q, k.values, v.values, table, context,
            k_new.to(k.values.dtype), v_new.to(k.values.dtype), width, scale,
        )  # fmt: skip
    else:  # k_new [R, Hkv, D] -> codes [R, Hkv, W], scales [R, Hkv, D / group]
        k_codes, k_scales = k.encoder.encode(k_new)
        v_codes, v_scales = v.encoder.encode(v_new)
        out = torch.ops.ninfer_cpu.decode_attention_coded(
            q, k.values, k.scales, v.values, v.scales, table, context,
            k_codes, k_scales, v_codes, v_scales, width, scale,
        )  # fmt: skip
    return out if rotation is None else rotation.inverse(out).to(dtype)
