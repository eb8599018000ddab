"""The dense decoder's single-sequence decode step as one traceable function.

`torch.compile` captures it whole (`ninfer_core/engine/compiled_step.py`): about 480
small ops of an eager step become a few dozen fused kernels and GEMM calls. What makes it
capturable:

- It writes nothing. Each layer attends over the cached keys (the pages as gathered,
  the slot of this token masked) plus this token's own key, handled apart; the new K/V
  of every layer come back to the caller, which stores them in one call
  (`KVStore.write_layers`) after the graph. Writing into the pool inside the graph made
  the compiler copy the whole pool every step.
- Sizes that change every step are tensors or a dynamic dimension: the context length
  is a 0-dim tensor, the page table's length a dynamic size. One graph serves every
  context.
- No host reads and no branches on values; the kernel ops (`linear`, `rms_norm`,
  `apply_rope`, `silu_and_mul`) are the same the eager forward calls.

The attention is the reference's math (`_decode_one`): fp32 scores, softmax and sum.
"""

from __future__ import annotations

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
    """One query row over `context - 1` cached keys and its own key.

    q: [H, D]; k_old, v_old: [Hkv, L, D] (keys at `context - 1` and past are masked:
    padding, and the slot this token will be written to); k_new, v_new: [Hkv, D]
    -> [H, D] in q's dtype, computed in fp32.
    """
    hkv, length, d = k_old.shape
    qg = q.view(hkv, -1, d).float()  # [Hkv, G, D]
    kn, vn = k_new.float(), v_new.float()
    old = torch.matmul(qg, k_old.float().transpose(1, 2)) * scale  # [Hkv, G, L]
    stale = torch.arange(length, device=q.device) >= context - 1
    old = old.masked_fill(stale, float("-inf"))
    own = (qg * kn[:, None, :]).sum(-1, keepdim=True) * scale  # [Hkv, G, 1]
    probs = torch.cat((old, own), dim=-1).softmax(dim=-1)
    out = torch.matmul(probs[..., :length], v_old.float()) + probs[..., length:] * vn[:, None]
    return out.reshape(q.shape).to(q.dtype)


def _layer_attention(
    attn: Attention, x: torch.Tensor, cos, sin, kv_store, table: torch.Tensor, context
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = attn.project(x, cos, sin)  # [1, H, D], [1, Hkv, D]
    k_old, v_old = kv_store.gather_heads(attn.layer, table)  # [Hkv, P * BS, D]
    out = attend_with_new(q[0], k_old, v_old, k[0], v[0], attn.scale, context)
    return attn.output(out[None]), k, v


def dense_decode_graph(
    model: DenseDecoder,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_store,
    block_table: torch.Tensor,
    context: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`CausalLM.decode_graph` of a `DenseDecoder`: the same layers as its `forward`."""
    cos, sin = model.rotary(positions, model.dtype)
    x = model.embed(input_ids)
    keys, values = [], []
    for layer in model.layers:
        out, k, v = _layer_attention(
            layer.self_attn, layer.input_layernorm(x), cos, sin, kv_store, block_table, context
        )
        keys.append(k)
        values.append(v)
        h = x + out
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = model.compute_logits(model.norm(x))
    return logits, torch.stack(keys), torch.stack(values)
