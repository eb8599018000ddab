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
  pool (at `context - 1 + j`), then its own key (`decode_graph.attend_cached`, the
  decode step's attention with `width` rows a sequence: the CPU kernel over the pages in
  place, or the gathered pages with the earlier rows put in). Nothing is written inside
  the graph: the K/V of every row come back, and the caller stores the real rows'
  (`KVStore.write_layers`), as after a decode step.
- The page table may be wider than a lone decode's (it covers the last row); the
  kernel never reads past a row's keys, and in the gathered form keys past a row's
  position get probability exactly 0, which leaves its sums as without them
  (`kernels/reference.py`, `_decode_rows`). `tests/test_compiled_verify.py` checks rows
  against lone compiled decodes bit for bit.

A sequence with fewer rows than `width` (fewer drafts near `max_tokens`, or none) is
padded by the caller; a padded row only ever follows the real ones, so no real row
reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ninfer_core.model.decode_graph import attend_cached, run_layers

if TYPE_CHECKING:
    from ninfer_core.model.dense import DenseDecoder
    from ninfer_core.model.layers import Attention


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

    def attend(attn: Attention, x: torch.Tensor, cos, sin):
        q, k, v = attn.project(x, cos, sin)  # [R, H, D], [R, Hkv, D]
        out = attend_cached(kv_store, attn, q, k, v, block_table, context, width)
        return attn.output(out), k, v

    hidden, keys, values = run_layers(model, input_ids, positions, attend)
    return model.compute_logits(hidden), hidden, keys, values
