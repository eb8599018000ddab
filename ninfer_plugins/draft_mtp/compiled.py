"""A decoding round of the MTP drafter (its catch-up and every draft) as one graph
captured with `torch.compile`.

Eager, a round of k drafts is a catch-up forward of the MTP layer over the positions the
target's step kept, draft 1's argmax, then k - 1 single-token forwards, each followed by
the head and an argmax: on the built-in model in bf16, about 2.2 ms on 2 CPU cores, most
of it the dispatch of a few hundred small ops. Here the whole of it is one traceable
function (`draft_round`), compiled once per (batch size, k) when the engine compiles its
own steps (`--compile-decode`, `DraftTarget.compile_steps`): about 1.0 ms. The catch-up
is padded to k + 1 entries (a round keeps 1 to k + 1), so one graph serves every round.

As the compiled decode step, it writes nothing: catch-up entry r attends over the
layer's cached keys with entries 0..r-1's new keys where they will be stored, as a
verifying forward's rows do (`attend_cached`), draft step i over those and the steps
before it, each with its own key apart (`attend_with_new`); every K/V comes back and is
stored after the graph (`KVStore.write_layers`). Drafts change only what is accepted,
never the output, so the fused kernels' rounding (fp32 inside, rounded once) needs no
agreement with the eager forwards; in fp32 they draft the same tokens
(`tests/test_compiled_verify.py`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ninfer_core.engine.compiled_step import (
    compile_graph,
    failure_reason,
    graph_table,
    own_code,
    store_refusal,
)
from ninfer_core.model.decode_graph import attend_cached, attend_with_new, new_at_keys

if TYPE_CHECKING:
    from ninfer_core.spec.draft_head import DraftHead
    from ninfer_plugins.draft_mtp.layer import MTPLayer

log = logging.getLogger(__name__)


def draft_round(
    layer: MTPLayer,
    head: DraftHead,
    embed,
    rotary,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    count: torch.Tensor,
    steps: int,
    store,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A round's catch-up and every draft of B sequences, each with `W` catch-up rows.

    ids, hidden, positions: [B * W], [B * W, hidden], [B * W], sequence-major: entry j of
    each sequence reads token j + 1 and the target's hidden at j (its first `count[b]`
    rows real, the rest copies of the last); table: [B, P] pages covering every entry up
    to the last draft's. -> (drafts [1 + steps, B] int64; catch-up k, v [B * W, Hkv, D];
    draft steps' k, v [steps, B, Hkv, D]). `embed`: token ids -> the layer's embedding
    input (`MTPDrafter._embed`); `rotary`: the target's.
    """
    b = count.shape[0]
    width = ids.shape[0] // b
    attn, decoder = layer.layer.self_attn, layer.layer
    first = positions.view(b, width)[:, 0]  # [B]: each sequence's first catch-up entry
    ends = first + count  # [B]: `end`, the first draft entry
    later = ends[None, :] + torch.arange(steps, device=ends.device)[:, None]  # [S, B]
    cos, sin = rotary(torch.cat((positions, later.reshape(-1))), layer.dtype)
    k_old, v_old = store.gather_heads(attn.layer, table)  # [B, Hkv, L, D]

    # The catch-up: row r attends over the cache and rows 0..r-1, as one causal forward.
    n = positions.shape[0]
    e_h = torch.cat((embed(ids), layer.pre_fc_norm_hidden(hidden)), dim=-1)
    x = layer.ops.linear(e_h, layer.fc).float()
    q, k, v = attn.project(decoder.input_layernorm(x), cos[:n], sin[:n])
    context = first + 1
    # a verifying forward's rows, over the pages the drafts below read too
    out = attend_cached(store, attn, q, k, v, table, context, width, (k_old, v_old))
    outs = layer.norm(decoder.mlp_block(x + attn.output(out)))  # [B * W, hidden]
    last = (torch.arange(b, device=ids.device) * width + count - 1).long()
    hidden = outs.index_select(0, last)  # [B, hidden]: the MTP's output at end - 1
    tokens = [head.argmax(hidden)]  # draft 1

    # The drafts: the cache with every real catch-up row in place, then each step's.
    k_cache = _with_rows(k_old, k, context, width, count)
    v_cache = _with_rows(v_old, v, context, width, count)
    slots = torch.arange(k_cache.shape[2], device=ids.device)
    cos_d, sin_d = cos[n:].view(steps, b, -1), sin[n:].view(steps, b, -1)
    keys, values = [], []
    for i in range(steps):
        here = ends + 1 + i  # [B]: this step's context (its entry + 1)
        e_h = torch.cat((embed(tokens[-1]), layer.pre_fc_norm_hidden(hidden)), dim=-1)
        x = layer.ops.linear(e_h, layer.fc).float()
        q, kd, vd = attn.project(decoder.input_layernorm(x), cos_d[i], sin_d[i])
        out = attend_with_new(q, k_cache, v_cache, kd, vd, attn.scale, here)
        hidden = layer.norm(decoder.mlp_block(x + attn.output(out)))
        tokens.append(head.argmax(hidden))
        # The next step finds this one's K/V where they will be stored.
        at = (slots[None, :] == (here - 1)[:, None])[:, None, :, None]  # [B, 1, L, 1]
        k_cache = torch.where(at, kd[:, :, None, :], k_cache)
        v_cache = torch.where(at, vd[:, :, None, :], v_cache)
        keys.append(kd)
        values.append(vd)
    return torch.stack(tokens), k, v, torch.stack(keys), torch.stack(values)


def _with_rows(
    old: torch.Tensor, new: torch.Tensor, context: torch.Tensor, width: int, count: torch.Tensor
) -> torch.Tensor:
    """`old` [B, Hkv, L, D] with each sequence's first `count` rows of `new` [B * W, Hkv,
    D] at keys `context - 1 + j` (`with_earlier_rows` for one row past the last)."""
    rel, at = new_at_keys(old, new, context, width)
    placed = (rel >= 0) & (rel < count[:, None])  # [B, L]
    return torch.where(placed[:, None, :, None], at, old)


def draft_refusal(layer: torch.nn.Module, store) -> str | None:
    """Why the draft steps of `layer` over `store` can't be captured, or None."""
    from ninfer_plugins.draft_mtp.layer import MTPLayer

    if type(layer) is not MTPLayer:
        return "the family's own MTP layer has no captured draft step"
    return store_refusal(store, "the drafter's KV store")


#: `draft_round`'s arguments fixed for a drafter's life: its layer, head, embedding,
#: the target's RoPE and the drafter's KV store.
FIXED = ("layer", "head", "embed", "rotary", "store")


class CompiledDraftRound:
    """Runs `draft_round` compiled; a failure is logged once and leaves the eager path."""

    def __init__(self, layer: MTPLayer, head: DraftHead, embed, rotary, store, steps: int) -> None:
        self.layer, self.head, self.embed, self.store = layer, head, embed, store
        self.rotary, self.steps_after_first = rotary, steps
        # Its own code, so the guards on the drafter's fixed parts can go (`compile_graph`).
        self._fn = compile_graph(own_code(draft_round), fixed=FIXED, dynamic={"table": 1})
        #: Why it stopped being used, once it failed; None while it works.
        self.failed: str | None = None
        #: Rounds it drafted.
        self.steps = 0

    def run(
        self,
        ids: list[int],
        hidden: torch.Tensor,
        positions: list[int],
        counts: list[int],
        tables: torch.Tensor,
        slots: list[int],
        draft_slots: torch.Tensor,
    ) -> torch.Tensor | None:
        """Drafts [1 + steps, B] (the catch-up's K/V stored at `slots`, one per real row,
        the drafts' at `draft_slots` [steps, B]), or None when the compiled function
        failed: the caller drafts eagerly (nothing was written)."""
        device = hidden.device
        table = graph_table(tables, tables.shape[1])
        width = len(ids) // len(counts)
        real = [b * width + j for b, n in enumerate(counts) for j in range(n)]
        try:
            drafts, k, v, kd, vd = self._fn(
                self.layer, self.head, self.embed, self.rotary,
                torch.tensor(ids, device=device), hidden.contiguous(),
                torch.tensor(positions, device=device),
                torch.tensor(counts, device=device), self.steps_after_first, self.store,
                table,
            )  # fmt: skip
        except Exception as exc:  # the compiler or its output, not the request
            self.failed = failure_reason(exc)
            log.warning("compiled MTP drafting failed, drafting eagerly from now on: %s",
                        self.failed)  # fmt: skip
            return None
        if len(real) != len(ids):
            keep = torch.tensor(real, device=device)
            k, v = k[keep], v[keep]
        s, b = kd.shape[0], kd.shape[1]
        self.store.write_layers(
            torch.cat((torch.tensor(slots, device=device), draft_slots.reshape(-1))),
            torch.cat((k, kd.reshape(s * b, *kd.shape[2:])))[None],
            torch.cat((v, vd.reshape(s * b, *vd.shape[2:])))[None],
        )
        self.steps += 1
        return drafts
