"""`MTPDrafter`: keeps the MTP layer's K/V in step with the target, and drafts from it.

Each `propose` runs one ragged forward of the MTP layer over every position the target's
step computed ("catch-up"): entry j of a sequence reads the target's hidden h_j and the
embedding of token j + 1, and its K/V go into the drafter's own one-layer store at the
sequence's slot for j (same pages as the target's pool, `spec/types.py`), so later
entries attend over every earlier one, as in training. The last catch-up entry, end - 1,
reads the pending token and predicts the token after it: draft 1. Drafts 2..k each take
one more single-token forward, batched over the sequences still drafting, at entries end,
end + 1, ...: the previous draft's embedding, and in place of the target's hidden state
(not computed yet) the MTP's own previous output, the same kind of value (after a final
norm). Those draft entries' K/V are provisional; the next catch-up rewrites them with
the target's hidden states of whatever was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ninfer_core.model.attention_meta import AttentionMetadata
from ninfer_core.plugin_types import KVStore
from ninfer_core.spec.draft_head import DraftHead
from ninfer_core.spec.types import NO_PROPOSAL, DraftInput, Proposal
from ninfer_plugins.draft_mtp.layer import MTPLayer

if TYPE_CHECKING:
    from ninfer_core.model.dense import DenseDecoder


@dataclass(frozen=True, slots=True)
class _Span:
    """A sequence as `AttentionMetadata.build` reads it: `length` tokens, of which
    `num_computed_tokens` are in the store before this forward."""

    seq_id: int
    num_computed_tokens: int
    block_table: list[int]
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class _Rows:
    """One input's catch-up entries `start:stop` (stop <= end), output rows from `offset`."""

    index: int
    start: int
    stop: int
    offset: int
    table: list[int]

    @property
    def last(self) -> int:
        return self.offset + self.stop - self.start - 1


class MTPDrafter:
    """Drafts with the target's MTP layer (see the module); its state is only the K/V in
    its own pages, so `release` has nothing to forget."""

    uses_hidden = True

    def __init__(
        self,
        layer: MTPLayer,
        target: DenseDecoder,
        head: DraftHead,
        store: KVStore,
        block_size: int,
    ) -> None:
        # `target`: the loaded model, whose `embed` and `rotary` the layer shares.
        self.layer, self.target, self.head = layer, target, head
        self.store, self.block_size = store, block_size
        self.device = store.device

    @torch.inference_mode()
    def propose(self, inputs: Sequence[DraftInput]) -> list[Proposal]:
        rows, out = self._catch_up(inputs)
        # Drafting needs the catch-up to have reached entry end - 1 (the pending token).
        active = [
            r for r in rows if inputs[r.index].max_drafts > 0 and r.stop == inputs[r.index].end
        ]
        if not active:
            return [NO_PROPOSAL] * len(inputs)
        hidden = out[torch.tensor([r.last for r in active], device=self.device)]  # [B, hidden]
        tokens = self.head.argmax(hidden)  # [B]: each sequence's draft 1
        steps = [(tokens, [r.index for r in active])]
        for i in range(1, max(inputs[r.index].max_drafts for r in active)):
            keep = [b for b, r in enumerate(active) if inputs[r.index].max_drafts > i]
            if len(keep) < len(active):  # some have every draft they may take
                sel = torch.tensor(keep, device=self.device)
                tokens, hidden = tokens[sel], hidden[sel]
                active = [active[b] for b in keep]
            # Entry end - 1 + i: draft i's embedding, and the MTP's own output before it.
            batch = [(r.table, inputs[r.index].end - 1 + i, 1) for r in active]
            hidden = self._forward(tokens, hidden, batch)
            tokens = self.head.argmax(hidden)
            steps.append((tokens, [r.index for r in active]))
        flat = iter(torch.cat([t for t, _ in steps]).tolist())  # one device sync
        drafts: dict[int, list[int]] = {}
        for _, owners in steps:
            for index in owners:
                drafts.setdefault(index, []).append(next(flat))
        return [
            Proposal(token_ids=drafts[i]) if i in drafts else NO_PROPOSAL
            for i in range(len(inputs))
        ]

    @torch.inference_mode()
    def catch_up(self, inputs: Sequence[DraftInput]) -> list[torch.Tensor]:
        """Per input, the MTP's final-normed output of each catch-up entry, [n, hidden]
        (n = end - start, fewer when the tokens after them are not known yet): the first
        thing `propose` runs, for tests to read logits through the target's head."""
        rows, out = self._catch_up(inputs)
        found = {r.index: out[r.offset : r.last + 1] for r in rows}
        empty = out.new_empty(0, out.shape[-1])
        return [found.get(i, empty) for i in range(len(inputs))]

    def release(self, seq_id: int) -> None:
        """Nothing to forget: the K/V live in the sequence's pages, which the engine reuses."""

    def _catch_up(self, inputs: Sequence[DraftInput]) -> tuple[list[_Rows], torch.Tensor]:
        """One forward over every input's catch-up entries -> (rows, outputs [R, hidden])."""
        rows: list[_Rows] = []
        offset = 0
        for index, inp in enumerate(inputs):
            # Entry j reads token j + 1: within a prefill chunk the prompt has it; a
            # decode's last entry reads the pending token.
            stop = min(inp.end, len(inp.token_ids) - 1)
            if stop > inp.start:
                rows.append(_Rows(index, inp.start, stop, offset, list(inp.block_table)))
                offset += stop - inp.start
        if not rows:
            return rows, torch.empty(0, self.layer.config.hidden_size, device=self.device)
        ids = [t for r in rows for t in inputs[r.index].token_ids[r.start + 1 : r.stop + 1]]
        hidden = torch.cat([_hidden(inputs[r.index])[: r.stop - r.start] for r in rows])
        next_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return rows, self._forward(
            next_ids, hidden, [(r.table, r.start, r.stop - r.start) for r in rows]
        )

    def _forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: list[tuple[list[int], int, int]]
    ) -> torch.Tensor:
        """One MTP forward over sequences given as (block table, first entry, entries):
        next_ids [T], hidden [T, hidden] -> [T, hidden]. Entries before each first one
        are read from the store."""
        spans = [
            (_Span(i, start, table, start + n), n) for i, (table, start, n) in enumerate(batch)
        ]
        meta = AttentionMetadata.build(spans, self.block_size, self.device)
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in batch])
        self.layer.ops.prepare(meta)
        cos, sin = self.target.rotary(positions.to(self.device), self.layer.dtype)  # [T, D/2]
        embeds = self.target.embed(next_ids)  # [T, hidden] fp32
        return self.layer(embeds, hidden.to(self.layer.dtype), cos, sin, meta, self.store)

    def __repr__(self) -> str:
        return f"MTPDrafter(store={self.store.layout})"


def _hidden(inp: DraftInput) -> torch.Tensor:
    """The input's hidden rows, checked: one per position start:end."""
    if inp.hidden is None:
        raise ValueError(f"sequence {inp.seq_id}: the MTP drafter needs the target's hidden states")
    if inp.hidden.shape[0] != inp.end - inp.start:
        raise ValueError(
            f"sequence {inp.seq_id}: {inp.hidden.shape[0]} hidden rows for positions "
            f"{inp.start}:{inp.end}"
        )
    return inp.hidden
