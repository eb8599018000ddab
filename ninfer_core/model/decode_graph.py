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

The attention is the reference's math (`_decode_rows`): fp32 scores, softmax and sum,
written as elementwise products and sums that the compiler fuses with the page gather.
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
    # Products and sums, not matmuls: the compiler fuses the page gather, the widening
    # to fp32 and the dot products into one pass over the cached keys (and one over the
    # values), where a matmul needs the gathered K/V widened into fp32 copies first
    # (twice the bytes of the bf16 pages, written then read again).
    old = (qg[:, :, :, None, :] * k_old[:, :, None, :, :].float()).sum(-1) * scale  # [B,Hkv,G,L]
    stale = torch.arange(length, device=q.device) >= (context - 1)[:, None]  # [B, L]
    old = old.masked_fill(stale[:, None, None, :], float("-inf"))
    own = (qg * kn).sum(-1, keepdim=True) * scale  # [B, Hkv, G, 1]
    probs = torch.cat((old, own), dim=-1).softmax(dim=-1)
    mixed = (probs[..., :length, None] * v_old[:, :, None, :, :].float()).sum(-2)
    out = mixed + probs[..., length:] * vn  # [B, Hkv, G, D]
    return out.reshape(q.shape).to(q.dtype)


#: A layer's attention inside a graph: (the layer's `Attention`, its normed input, cos,
#: sin) -> (its output projected back, this step's K, V).
LayerAttention = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def run_layers(
    model: DenseDecoder, input_ids: torch.Tensor, positions: torch.Tensor, attend: LayerAttention
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder's layers over one graph's rows, with `attend` as each layer's attention
    (the decode step's and the verifying forward's differ only there) -> final hidden
    states (normed) [R, hidden] and every layer's new K, V [layers, R, Hkv, D]."""
    cos, sin = model.rotary(positions, model.dtype)
    x = model.embed(input_ids)
    keys, values = [], []
    for layer in model.layers:
        out, k, v = attend(layer.self_attn, layer.input_layernorm(x), cos, sin)
        keys.append(k)
        values.append(v)
        x = layer.mlp_block(x + out)
    return model.norm(x), torch.stack(keys), torch.stack(values)


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
