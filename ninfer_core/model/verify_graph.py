"""The dense decoder's verifying forward (each of B sequences runs its pending token and
its drafts, `width` rows in all) as one traceable function, beside the decode step's
(`decode_graph.py`).

A speculative round's forward is the largest part of the round on the CPU, and eager it
is a decode step's ~480 small ops again; captured, it is a few dozen fused kernels, as
the compiled decode step is (`ninfer_core/engine/compiled_verify.py` runs it).

What keeps speculation lossless in bf16: every row is computed as the compiled decode
step computes that token decoded alone (`dense_decode_graph`), in one batch of
`B * width` rows:

- The projections, norms, RoPE and MLP are row by row.
- Row r of a sequence attends exactly as the lone decode at its position would: over the
  cached keys with rows 0..r-1's new keys where the lone decode would find them in the
  pool (at `context - 1 + j`), keys at its own slot and past masked, plus its own key
  apart (`attend_with_new`, the decode step's attention with a batch of `B * width`).
  Nothing is written inside the graph: the K/V of every row come back, and the caller
  stores the real rows' (`KVStore.write_layers`), as after a decode step.
- The page table may be wider than a lone decode's (it covers the last row); keys past a
  row's position get probability exactly 0, which leaves its sums as without them
  (`kernels/reference.py`, `_decode_rows`). `tests/test_compiled_verify.py` checks rows
  against lone compiled decodes bit for bit.

A sequence with fewer rows than `width` (fewer drafts near `max_tokens`, or none) is
padded by the caller; a padded row only ever follows the real ones, so no real row
reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ninfer_core.model.decode_graph import attend_with_new, run_layers

if TYPE_CHECKING:
    from ninfer_core.model.dense import DenseDecoder
    from ninfer_core.model.layers import Attention


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


def dense_verify_graph(
    model: DenseDecoder,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_store,
    block_table: torch.Tensor,
    context: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`CausalLM.verify_graph` of a `DenseDecoder`: input_ids, positions [B * width]
    (sequence-major), block_table [B, P], context [B] (row 0's) -> logits [B * width,
    vocab] fp32, final hidden states [B * width, hidden], and K, V [layers, B * width,
    Hkv, D] for the caller to store."""
    steps = torch.arange(width, device=context.device)
    row_context = (context[:, None] + steps[None, :]).reshape(-1)  # [R]: each row's own

    def attend(attn: Attention, x: torch.Tensor, cos, sin):
        q, k, v = attn.project(x, cos, sin)  # [R, H, D], [R, Hkv, D]
        k_old, v_old = kv_store.gather_heads(attn.layer, block_table)  # [B, Hkv, P * BS, D]
        k_rows = with_earlier_rows(k_old, k, context, width)
        v_rows = with_earlier_rows(v_old, v, context, width)
        out = attend_with_new(q, k_rows, v_rows, k, v, attn.scale, row_context)
        return attn.output(out), k, v

    hidden, keys, values = run_layers(model, input_ids, positions, attend)
    return model.compute_logits(hidden), hidden, keys, values
