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

A round is a few small forwards, each a hundred-odd small ops on the CPU, so what runs
once per round instead of once per step matters (`_DraftSteps`): the draft steps' slots,
page tables and RoPE are laid out once per `propose`, token ids stay on the device until
one `tolist` at the end, and a small vocabulary's normed embeddings are a table.

With `--compile-decode` a round of decoding sequences that draft a full k runs as one
compiled graph instead (`compiled.py`: the catch-up, padded to k + 1 entries, draft 1's
argmax and the k - 1 draft steps, the K/V stored after it); a prefill's catch-up and the
shorter rounds near `max_tokens` stay on the eager path above.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ninfer_core.model.attention_meta import AttentionMetadata, PagedSpan
from ninfer_core.plugin_types import KVStore, MTPBlock
from ninfer_core.spec.draft_head import DraftHead
from ninfer_core.spec.types import NO_PROPOSAL, DraftInput, Proposal
from ninfer_plugins.draft_mtp.compiled import CompiledDraftRound, draft_refusal

if TYPE_CHECKING:
    from ninfer_core.model.dense import DenseDecoder

log = logging.getLogger(__name__)

#: Bytes up to which the drafter keeps every token's normed embedding (the layer's first
#: input, a function of the token alone) as a table in the compute dtype. Computed per
#: call, a quantized embedding dequantizes its rows and the norm runs: about 0.1 ms of a
#: 0.8 ms draft step on 2 CPU cores (the built-in model); the table is one `index_select`
#: with the same numbers. The built-in model's (4096 x 256, bf16) takes 2 MiB; a large
#: vocabulary's never qualifies and is computed per call.
EMBED_TABLE_MAX_BYTES = 16 << 20


def embed_table_bytes(vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of the normed-embedding table a drafter keeps for a `vocab` x `hidden` model
    computing in `dtype`, or 0 where it computes the rows per call instead: one rule for
    the drafter and for the memory plan that counts it."""
    nbytes = vocab * hidden * dtype.itemsize
    return nbytes if nbytes <= EMBED_TABLE_MAX_BYTES else 0


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
        layer: MTPBlock,
        target: DenseDecoder,
        head: DraftHead,
        store: KVStore,
        block_size: int,
        *,
        compile_steps: int = 0,
    ) -> None:
        # `layer`: the MTP layer (`MTPLayer`, or the family's own `MTPBlock`).
        # `target`: the loaded model, whose `embed` and `rotary` the layer shares.
        self.layer, self.target, self.head = layer, target, head
        self.store, self.block_size = store, block_size
        self.device = store.device
        vocab, hidden = layer.config.vocab_size, layer.config.hidden_size
        #: [vocab, hidden] in the compute dtype: every token's `layer.embed_input`, or None
        #: (larger than `EMBED_TABLE_MAX_BYTES`: computed per call).
        self.embed_table: torch.Tensor | None = None
        if embed_table_bytes(vocab, hidden, layer.dtype):
            with torch.inference_mode():
                ids = torch.arange(vocab, device=self.device)
                self.embed_table = layer.embed_input(target.embed(ids))
        #: The round (catch-up and drafts) compiled (`compiled.py`), or None: eager.
        #: `compile_steps` (the engine compiles its own steps): the steps after draft 1 of
        #: a full round, k - 1; only full rounds of decoding sequences run compiled (one
        #: graph), a prefill's catch-up and the shorter rounds near `max_tokens` eagerly,
        #: which saves compiling a graph for each.
        self.compiled: CompiledDraftRound | None = None
        if compile_steps > 0:
            refusal = draft_refusal(layer, store)
            if refusal is None:
                self.compiled = CompiledDraftRound(
                    layer, head, self._embed, target.rotary, store, compile_steps
                )
            else:
                log.warning("--compile-decode: MTP drafting runs eagerly: %s", refusal)

    @torch.inference_mode()
    def propose(self, inputs: Sequence[DraftInput]) -> list[Proposal]:
        rows = self._rows(inputs)
        # Drafting needs the catch-up to have reached entry end - 1 (the pending token).
        active = [
            r for r in rows if inputs[r.index].max_drafts > 0 and r.stop == inputs[r.index].end
        ]
        if not active:
            self._catch_up(inputs, rows)
            return [NO_PROPOSAL] * len(inputs)
        budgets = [inputs[r.index].max_drafts for r in active]
        plan = None
        if max(budgets) > 1:
            ends = [inputs[r.index].end for r in active]
            tables = [r.table for r in active]
            plan = _DraftSteps(ends, tables, max(budgets) - 1, self.block_size, self.device)
        owners = [r.index for r in active]
        drafted = None
        if plan is not None and self._compiles(rows, active, budgets, plan):
            drafted = self._propose_compiled(inputs, active, plan)
        if drafted is not None:
            steps = [(row, owners) for row in drafted]
        else:
            out, cos, sin = self._catch_up(inputs, rows, [] if plan is None else plan.positions)
            hidden = out[torch.tensor([r.last for r in active], device=self.device)]  # [B, hidden]
            tokens = self.head.argmax(hidden)  # [B]: each sequence's draft 1
            steps = [(tokens, owners)]
            if plan is not None:
                steps += self._draft(plan, budgets, owners, tokens, hidden, cos, sin)
        flat = iter(torch.cat([t for t, _ in steps]).tolist())  # one device sync
        drafts: dict[int, list[int]] = {}
        for _, indices in steps:
            for index in indices:
                drafts.setdefault(index, []).append(next(flat))
        return [
            Proposal(token_ids=drafts[i]) if i in drafts else NO_PROPOSAL
            for i in range(len(inputs))
        ]

    def _compiles(self, rows, active, budgets, plan: _DraftSteps) -> bool:
        """Whether this round runs the compiled graph: every sequence decoding (its
        catch-up one round's rows at most) and drafting a full round."""
        c = self.compiled
        if c is None or c.failed is not None or len(rows) != len(active):
            return False
        width = c.steps_after_first + 2  # k + 1
        return plan.steps == c.steps_after_first == min(budgets) - 1 and all(
            r.stop - r.start <= width for r in rows
        )

    def _propose_compiled(
        self, inputs: Sequence[DraftInput], active: list[_Rows], plan: _DraftSteps
    ) -> list[torch.Tensor] | None:
        """Each sequence's drafts through the compiled round: [B] tensors, draft 1 first;
        None when it failed (draft eagerly: nothing was written)."""
        width = self.compiled.steps_after_first + 2
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        picks: list[torch.Tensor] = []
        for r in active:
            inp = inputs[r.index]
            n = r.stop - r.start
            pad = width - n
            ids += inp.token_ids[r.start + 1 : r.stop + 1] + [inp.token_ids[r.stop]] * pad
            positions += list(range(r.start, r.stop)) + [r.stop - 1] * pad
            slots += [r.table[p // bs] * bs + p % bs for p in range(r.start, r.stop)]
            rows = _hidden(inp)[:n]
            picks.append(rows if not pad else torch.cat((rows, rows[-1:].expand(pad, -1))))
        hidden = (picks[0] if len(picks) == 1 else torch.cat(picks)).to(self.layer.dtype)
        counts = [r.stop - r.start for r in active]
        drafts = self.compiled.run(ids, hidden, positions, counts, plan.tables, slots, plan.slots)
        return None if drafts is None else list(drafts.unbind(0))

    def _draft(
        self,
        plan: _DraftSteps,
        budgets: list[int],
        owners: list[int],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> list[tuple[torch.Tensor, list[int]]]:
        """The single-token steps after draft 1: B sequences (`owners`, their input
        indices) with `budgets` drafts, draft 1 `tokens` [B] after MTP outputs `hidden`
        [B, hidden], RoPE `cos`, `sin` [S * B, D/2] of `plan.positions` -> each step's
        tokens (on the device) and the input indices they belong to."""
        b = len(owners)
        cos, sin = cos.view(plan.steps, b, -1), sin.view(plan.steps, b, -1)
        keep = list(range(b))  # the sequences still drafting, as rows of the plan
        steps: list[tuple[torch.Tensor, list[int]]] = []
        for i in range(1, plan.steps + 1):
            if any(budgets[j] <= i for j in keep):  # some have every draft they may take
                kept = [n for n, j in enumerate(keep) if budgets[j] > i]
                sel = torch.tensor(kept, device=self.device)
                tokens, hidden = tokens[sel], hidden[sel]
                keep = [keep[n] for n in kept]
            rows = slice(None) if len(keep) == b else torch.tensor(keep, device=self.device)
            # Entry end - 1 + i: draft i's embedding, and the MTP's own output before it.
            meta = plan.meta(i, keep, rows)
            self.layer.ops.prepare(meta)
            hidden = self.layer(
                self._embed(tokens), hidden, cos[i - 1][rows], sin[i - 1][rows], meta, self.store
            )
            tokens = self.head.argmax(hidden)
            steps.append((tokens, [owners[j] for j in keep]))
        return steps

    @torch.inference_mode()
    def catch_up(self, inputs: Sequence[DraftInput]) -> list[torch.Tensor]:
        """Per input, the MTP's final-normed output of each catch-up entry, [n, hidden]
        (n = end - start, fewer when the tokens after them are not known yet): the first
        thing `propose` runs, for tests to read logits through the target's head."""
        rows = self._rows(inputs)
        out, _, _ = self._catch_up(inputs, rows)
        found = {r.index: out[r.offset : r.last + 1] for r in rows}
        empty = out.new_empty(0, out.shape[-1])
        return [found.get(i, empty) for i in range(len(inputs))]

    def release(self, seq_id: int) -> None:
        """Nothing to forget: the K/V live in the sequence's pages, which the engine reuses."""

    @staticmethod
    def _rows(inputs: Sequence[DraftInput]) -> list[_Rows]:
        """Each input's catch-up entries, laid out as one flat batch."""
        rows: list[_Rows] = []
        offset = 0
        for index, inp in enumerate(inputs):
            # Entry j reads token j + 1: within a prefill chunk the prompt has it; a
            # decode's last entry reads the pending token.
            stop = min(inp.end, len(inp.token_ids) - 1)
            if stop > inp.start:
                rows.append(_Rows(index, inp.start, stop, offset, list(inp.block_table)))
                offset += stop - inp.start
        return rows

    def _catch_up(
        self, inputs: Sequence[DraftInput], rows: list[_Rows], later: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward over the catch-up entries `rows` -> (outputs [R, hidden], and RoPE's
        cos, sin [len(later), D/2] of the positions `later`, computed in the same call)."""
        dim = self.layer.config.hidden_size
        positions = [p for r in rows for p in range(r.start, r.stop)]
        pos = torch.tensor(positions + list(later), dtype=torch.int64)
        cos, sin = self.target.rotary(pos.to(self.device), self.layer.dtype)  # [R + N, D/2]
        n = len(positions)
        if not rows:
            return torch.empty(0, dim, device=self.device), cos[n:], sin[n:]
        ids = [t for r in rows for t in inputs[r.index].token_ids[r.start + 1 : r.stop + 1]]
        hidden = [_hidden(inputs[r.index])[: r.stop - r.start] for r in rows]
        spans = [
            (PagedSpan(i, r.start, r.table, r.stop), r.stop - r.start) for i, r in enumerate(rows)
        ]
        meta = AttentionMetadata.build(spans, self.block_size, self.device)
        self.layer.ops.prepare(meta)
        next_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        out = self.layer(
            self._embed(next_ids),  # [R, hidden]
            (hidden[0] if len(hidden) == 1 else torch.cat(hidden)).to(self.layer.dtype),
            cos[:n], sin[:n], meta, self.store,
        )  # fmt: skip
        return out, cos[n:], sin[n:]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the layer's embedding input [T, hidden] (`MTPBlock.embed_input`)."""
        if self.embed_table is None:
            return self.layer.embed_input(self.target.embed(ids))
        return self.embed_table.index_select(0, ids)

    def __repr__(self) -> str:
        return f"MTPDrafter(store={self.store.layout})"


class _DraftSteps:
    """The single-token draft steps after draft 1 in one `propose`, laid out once for all
    of them: step i (1..`steps`) runs entry end - 1 + i of each sequence. Their positions
    join the catch-up's in one RoPE call; their slots, context lengths and page tables are
    rows of tensors made here, so a step builds no metadata from Python lists."""

    def __init__(
        self,
        ends: list[int],
        tables: list[list[int]],
        steps: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        bs, b = block_size, len(ends)
        for table, end in zip(tables, ends, strict=True):
            if end + steps > len(table) * bs:
                raise ValueError(f"{len(table)} pages for drafts up to entry {end + steps - 1}")
        self.ends, self.steps, self.block_size = ends, steps, block_size
        #: [S * B] host ints: the entries, step-major.
        self.positions = [end - 1 + i for i in range(1, steps + 1) for end in ends]
        width = -(-(max(ends) + steps) // bs)  # pages the last step reads at most
        slots = [tables[j % b][e // bs] * bs + e % bs for j, e in enumerate(self.positions)]

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

        #: [S, B] int64: each entry's KV slot.
        self.slots = tensor(slots, torch.int64).view(steps, b)
        #: [S, B] int32: each sequence's context length after the step (entry + 1).
        self.context = tensor([e + 1 for e in self.positions], torch.int32).view(steps, b)
        #: [B, width] int32: the page tables, padded with page 0 as `AttentionMetadata.build`.
        self.tables = tensor(
            [t[:width] + [0] * (width - len(t[:width])) for t in tables], torch.int32
        )
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=device)  # [B + 1]

    def meta(self, i: int, keep: list[int], rows: slice | torch.Tensor) -> AttentionMetadata:
        """Step i's metadata for the sequences `keep` (their rows of the tensors: `rows`)."""
        context = [self.ends[b] + i for b in keep]
        pages = -(-max(context) // self.block_size)
        return AttentionMetadata(
            block_size=self.block_size,
            query_lens=[1] * len(keep),
            context_lens=context,
            max_query_len=1,
            max_context_len=max(context),
            query_start_loc=self.query_start[: len(keep) + 1],
            context_lens_tensor=self.context[i - 1][rows],
            block_tables=self.tables[rows, :pages].contiguous(),
            slot_mapping=self.slots[i - 1][rows],
        )


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
