"""`ModelRunner`: runs one step of a batch through the model and returns next-token logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.compiled_step import CompiledDecode
from ninfer_core.engine.compiled_verify import CompiledVerify, verify_refusal
from ninfer_core.engine.sequence import Sequence
from ninfer_core.kv.state import SequenceStatePool, StepStates
from ninfer_core.memory.heap import HeapTrimmer
from ninfer_core.model.attention_meta import AttentionMetadata


@dataclass
class StepForward:
    """What one forward gives the engine."""

    #: [R, vocab] fp32: the rows `ModelRunner.step` chose, in batch order.
    logits: torch.Tensor
    #: [T, hidden]: every token's final hidden state (None unless the runner keeps them).
    hidden: torch.Tensor | None = None

    @staticmethod
    def cat(parts: Seq[StepForward]) -> StepForward:
        """The forwards of consecutive parts of a batch, as one."""
        hidden = [p.hidden for p in parts]
        return StepForward(
            torch.cat([p.logits for p in parts]),
            None if any(h is None for h in hidden) else torch.cat(hidden),
        )


class ModelRunner:
    """Executes what the scheduler decided; it makes no policy.

    One `run` is one forward over every scheduled token (prefill chunks and decode
    tokens alike, flattened varlen). All metadata tensors are built before the forward,
    so the layer loop never waits on the host.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_store,
        block_manager: BlockManager,
        states: SequenceStatePool | None = None,
        compiled: CompiledDecode | None = None,
    ) -> None:
        self.model = model
        self.kv_store = kv_store
        self.block_manager = block_manager
        #: Per-sequence states of the state layers (each running sequence holds a slot).
        self.states = states
        #: The compiled decode step (`--compile-decode`), or None.
        self.compiled = compiled
        #: The compiled round forward (`--compile-decode` with `--spec`), or None.
        self.verify: CompiledVerify | None = None
        #: `step` returns every token's final hidden state (a drafter that reads them is on).
        self.keep_hidden = False
        self.device = next(model.parameters()).device
        #: On the CPU, what evicted oneDNN kernels and a prefill's temporaries free goes back
        #: to the kernel (memory/heap.py). Here, not in a kernel backend: the heap is the
        #: process's, whichever backend serves the step's ops.
        self.heap = HeapTrimmer() if self.device.type == "cpu" else None

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def compile_rounds(self, draft_tokens: int) -> str | None:
        """With the compiled decode step on, run speculative rounds of up to
        `draft_tokens` drafts through a compiled graph too (`compiled_verify.py`): rows
        computed as the compiled decode step computes them, so greedy output is the same
        with and without speculation. Returns why not, or None (also when the decode
        step is not compiled: nothing to match)."""
        if self.compiled is None:
            return None
        refusal = verify_refusal(self.model, self.kv_store)
        if refusal is None:
            self.verify = CompiledVerify(
                self.model, self.kv_store, self.block_size, 1 + draft_tokens,
                self.compiled.max_batch, self.states,
            )  # fmt: skip
        return refusal

    def prepare(
        self, batch: Seq[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [T], positions [T], metadata) for running `n` tokens of each sequence
        (its pending tokens, then the drafts it verifies).

        Grows block tables where needed; the scheduler has checked `can_allocate`.
        """
        ids: list[int] = []
        positions: list[int] = []
        for seq, n in batch:
            self.block_manager.allocate(seq, n)
            start = seq.num_computed_tokens
            ids.extend(seq.run_ids(start, n))
            positions.extend(range(start, start + n))
        decodes = next((i for i, (s, _) in enumerate(batch) if s.is_prefilling), len(batch))
        meta = AttentionMetadata.build(batch, self.block_size, self.device, leading_decodes=decodes)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        return input_ids, pos, meta

    @torch.inference_mode()
    def run(self, batch: Seq[tuple[Sequence, int]], *, all_tokens: bool = False) -> torch.Tensor:
        """Run `n` new tokens of each `(seq, n)`; logits [B, vocab] fp32 of each one's last token.

        `all_tokens=True` returns logits [T, vocab] for every new token instead (what
        perplexity needs). Afterwards each sequence's `num_computed_tokens` has advanced
        by `n` (its K/V are in the cache); appending the sampled token is the caller's job.
        """
        rows = slice(None) if all_tokens else None
        return self._forward(batch, rows, keep_hidden=False).logits

    @torch.inference_mode()
    def step(self, batch: Seq[tuple[Sequence, int]]) -> StepForward:
        """The engine's forward: logits of each sequence's last `1 + len(draft_ids)` tokens
        (its next-token row, or the rows that verify its drafts), in batch order, and
        every token's final hidden state when `keep_hidden` (a drafter reads them)."""
        rows = None
        if any(seq.draft_ids for seq, _ in batch):
            index: list[int] = []
            end = 0
            for seq, n in batch:
                end += n
                index.extend(range(end - 1 - len(seq.draft_ids), end))
            rows = torch.tensor(index, dtype=torch.int64).to(self.device, non_blocking=True)
        return self._forward(batch, rows, keep_hidden=self.keep_hidden)

    def _forward(
        self,
        batch: Seq[tuple[Sequence, int]],
        rows: torch.Tensor | slice | None,
        keep_hidden: bool,
    ) -> StepForward:
        """One forward; logits of `rows` of the flat batch (None: each sequence's last)."""
        if self.heap is not None and any(n > 1 for _, n in batch):
            self.heap.maybe_trim()  # a prefill step: new shapes, large temporaries
        input_ids, positions, meta = self.prepare(batch)
        plain = rows is None and not keep_hidden
        step = None if self.states is None else self.states.step([s.state_slot for s, _ in batch])
        if not plain and self.verify is not None and self.verify.takes(batch):
            out = self.verify.run(batch, input_ids, positions, meta, step)
            if out is not None:  # else it failed (and said why): run the step eagerly
                logits = out[0][final_rows(meta) if rows is None else rows]  # [T] -> chosen
                return self._advanced(
                    batch, step, StepForward(logits, out[1] if keep_hidden else None)
                )
        if plain and self.compiled is not None and self.compiled.takes(batch):
            logits = self.compiled.run(input_ids, positions, meta, step)
            if logits is not None:  # else it failed (and said why): run the step eagerly
                return self._advanced(batch, step, StepForward(logits))
        if step is None:
            hidden = self.model(input_ids, positions, meta, self.kv_store)  # [T, hidden]
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_store, states=step)
        if rows is None:
            rows = final_rows(meta)
        logits = self.model.compute_logits(hidden[rows])
        return self._advanced(batch, step, StepForward(logits, hidden if keep_hidden else None))

    def _advanced(
        self, batch: Seq[tuple[Sequence, int]], step: StepStates | None, out: StepForward
    ) -> StepForward:
        """After a forward that succeeded: its states made current, the computed counts
        advanced; returns `out`."""
        if step is not None:
            step.commit()  # only now: a forward that raised left every state as it was
        for seq, n in batch:
            seq.num_computed_tokens += n
            if step is not None:
                seq.state_position = seq.num_computed_tokens
        return out


def final_rows(meta: AttentionMetadata) -> torch.Tensor:
    """[B]: each sequence's last row of the flat step."""
    return meta.query_start_loc[1:].long() - 1
