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
Where the store's pages suit it, the CPU kernel of `kernels/cpu_attention.py` reads them
in place (`attend_cached`); otherwise it is written as elementwise products and sums that
the compiler fuses with the page gather (`attend_with_new`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ninfer_core.kernels import cpu_attention

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


def attend_cached(
    kv_store,
    attn: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor,
    context: torch.Tensor,
    width: int = 1,
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Row j of each of B sequences (`width` rows a sequence, sequence-major) over the
    sequence's cached keys, then the new keys of its rows 0..j, as a lone decode at that
    position finds them in the pool.

    q: [B * width, H, D]; k, v: [B * width, Hkv, D]; block_table: [B, P]; context: [B],
    row 0's key count -> [B * width, H, D]. Where the store's pages suit it, the CPU
    kernel reads them in place (`kernels/cpu_attention.py`); otherwise the pages are
    gathered (or taken from `gathered`, the caller's `gather_heads` of them) and the rows'
    views of them built (`with_earlier_rows`) for `attend_with_new`. Either way every
    row is computed as that row alone would be, so a speculative round's rows equal lone
    decodes bit for bit. A store that keeps K/V coded or rotated (int8, rk8v4) gets the
    new rows as it will keep them (`read_back`; the kernel codes them itself).
    """
    pages = cpu_attention.served_pages(kv_store, attn.layer, q.shape[1])
    if pages is not None:
        return cpu_attention.decode_attention(
            q, pages, block_table, context, k, v, width, attn.scale
        )
    # [B, Hkv, P * BS, D] each, decoded and un-rotated
    k_old, v_old = gathered or kv_store.gather_heads(attn.layer, block_table)
    k, v = read_back(kv_store, attn.layer, k, v, k_old.dtype)
    if width == 1:
        return attend_with_new(q, k_old, v_old, k, v, attn.scale, context)
    steps = torch.arange(width, device=context.device)
    row_context = (context[:, None] + steps[None, :]).reshape(-1)  # [R]: each row's own
    k_rows = with_earlier_rows(k_old, k, context, width)
    v_rows = with_earlier_rows(v_old, v, context, width)
    return attend_with_new(q, k_rows, v_rows, k, v, attn.scale, row_context)


def read_back(
    kv_store, layer: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's k, v [R, Hkv, D] as a later step reads them from a store that keeps
    them coded or rotated (`KVPages.read_back`, in the gathered pages' `dtype`), so its
    own rows weigh as the eager step's, which reads them back from the pool; a store of
    float pages (or one that describes none) gets them as computed."""
    if kv_store.raw_pages is None:  # an optional member of the KVStore contract
        return k, v
    pages = kv_store.raw_pages(layer)
    if pages.rotation is None and pages.k.encoding == pages.v.encoding == "float":
        return k, v
    k, v = pages.read_back(k, v)
    return k.to(dtype), v.to(dtype)


def with_earlier_rows(
    old: torch.Tensor, new: torch.Tensor, context: torch.Tensor, width: int
) -> torch.Tensor:
    """Each row's view of the cache: `old` with the new entries of the sequence's earlier
    rows in the slots a lone decode finds them in.

    old: [B, Hkv, L, D] (pages as gathered); new: [B * width, Hkv, D]; context: [B], row
    0's context (computed tokens + 1) -> [B * width, Hkv, L, D]: row r of sequence b holds
    new[b, j] at key `context[b] - 1 + j` for j < r, else `old[b]`.
    """
    b, hkv, length, d = old.shape
    rel, at = new_at_keys(old, new, context, width)
    rows = torch.arange(width, device=old.device)[None, :, None]  # [1, W, 1]
    earlier = (rel[:, None, :] >= 0) & (rel[:, None, :] < rows)  # [B, W, L]
    out = torch.where(earlier[:, :, None, :, None], at[:, None], old[:, None])
    return out.reshape(b * width, hkv, length, d)


def new_at_keys(
    old: torch.Tensor, new: torch.Tensor, context: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each sequence's new entries go among the gathered keys.

    old: [B, Hkv, L, D]; new: [B * width, Hkv, D]; context: [B], row 0's context ->
    (rel [B, L]: key l's offset from the sequence's first new entry, at `context - 1`;
    at [B, Hkv, L, D]: the new entry `rel` names, clamped to 0 .. width - 1, which the
    caller keeps only where `rel` says the key holds one)."""
    b, hkv, length, d = old.shape
    rel = torch.arange(length, device=old.device)[None, :] - (context - 1)[:, None]  # [B, L]
    index = rel.clamp(0, width - 1)[:, None, :, None].expand(b, hkv, length, d)
    at = torch.gather(new.view(b, width, hkv, d).transpose(1, 2), 2, index)  # [B, Hkv, L, D]
    return rel, at


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
        return attn.output(attend_cached(kv_store, attn, q, k, v, block_table, context)), k, v

    hidden, keys, values = run_layers(model, input_ids, positions, attend)
    return model.compute_logits(hidden), keys, values
