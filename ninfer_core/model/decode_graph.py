"""The dense decoder's decode step (one new token for each of B sequences) as one
traceable function.

`torch.compile` captures it whole (`ninfer_core/engine/compiled_step.py`): about 480
small ops of an eager step become a few dozen fused kernels and GEMM calls. What makes it
capturable:

- It writes nothing. Each layer attends over the cached keys (the pages as gathered,
  the slot of this token masked) plus this token's own key, handled apart; the new K/V
  of every layer come back to the caller, which stores them in one call
  (`KVStore.write_layers`) after the graph. Writing into the pool inside the graph made
  the compiler copy the whole pool every step.
- Sizes that change every step are tensors or a dynamic dimension: the context lengths
  are a tensor, the page table's length a dynamic size. One graph serves every context
  (one per batch size).
- No host reads and no branches on values; the kernel ops (`linear`, `rms_norm`,
  `apply_rope`, `silu_and_mul`) are the same the eager forward calls.

The attention is the reference's math (`_decode_rows`): fp32 scores, softmax and sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ninfer_core.model.dense import DenseDecoder
    from ninfer_core.model.layers import Attention


def attend_with_new(
    q: torch.Tensor,
    k_old: torch.Tensor,
    v_old: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scale: float,
    context: torch.Tensor,
) -> torch.Tensor:
    """Each sequence's query row over its `context - 1` cached keys and its own key.

    q: [B, H, D]; k_old, v_old: [B, Hkv, L, D] (keys at `context - 1` and past are
    masked: padding, and the slot this token will be written to); k_new, v_new:
    [B, Hkv, D]; context: [B] -> [B, H, D] in q's dtype, computed in fp32.
    """
    b, hkv, length, d = k_old.shape
    qg = q.reshape(b, hkv, -1, d).float()  # [B, Hkv, G, D]
    kn, vn = k_new.float()[:, :, None, :], v_new.float()[:, :, None, :]  # [B, Hkv, 1, D]
    old = torch.matmul(qg, k_old.float().transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    stale = torch.arange(length, device=q.device) >= (context - 1)[:, None]  # [B, L]
    old = old.masked_fill(stale[:, None, None, :], float("-inf"))
    own = (qg * kn).sum(-1, keepdim=True) * scale  # [B, Hkv, G, 1]
    probs = torch.cat((old, own), dim=-1).softmax(dim=-1)
    out = torch.matmul(probs[..., :length], v_old.float()) + probs[..., length:] * vn
    return out.reshape(q.shape).to(q.dtype)


def _layer_attention(
    attn: Attention, x: torch.Tensor, cos, sin, kv_store, table: torch.Tensor, context
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = attn.project(x, cos, sin)  # [B, H, D], [B, Hkv, D]
    k_old, v_old = kv_store.gather_heads(attn.layer, table)  # [B, Hkv, P * BS, D]
    out = attend_with_new(q, k_old, v_old, k, v, attn.scale, context)
    return attn.output(out), k, v


def dense_decode_graph(
    model: DenseDecoder,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_store,
    block_table: torch.Tensor,
    context: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`CausalLM.decode_graph` of a `DenseDecoder`: the same layers as its `forward`."""

    def attend(attn: Attention, x: torch.Tensor, cos, sin):
        q, k, v = attn.project(x, cos, sin)  # [B, H, D], [B, Hkv, D]
        k_old, v_old = kv_store.gather_heads(attn.layer, block_table)  # [B, Hkv, P * BS, D]
        return attn.output(attend_with_new(q, k_old, v_old, k, v, attn.scale, context)), k, v

    hidden, keys, values = run_layers(model, input_ids, positions, attend)
    return model.compute_logits(hidden), keys, values
