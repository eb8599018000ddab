"""`CompiledVerify`: a speculative round's forward captured with `torch.compile`.

With `--compile-decode` a plain decode step runs through a compiled graph
(`compiled_step.py`), but a round's forward (each sequence's pending token and its k
drafts, and the final hidden states an MTP drafter reads) ran eagerly: on the built-in
model in bf16 with k = 3, 2.4 ms against a 0.85 ms compiled decode step (1.4 ms compiled,
docs/performance.md). This runs it through the model's `verify_graph`
(`model/verify_graph.py`): one graph per batch size, its width 1 + the configured draft
count, fixed per engine. A sequence with fewer rows (fewer drafts near `max_tokens`, none
proposed) is padded to the width with copies of its last row, whose outputs are dropped:
one graph serves every round, and every row is computed as the compiled decode step
computes it alone, so greedy output stays the (compiled) baseline's in bf16.

It takes a step only when every sequence decodes (its rows are its pending tokens and its
drafts: more than one pending token on a model with per-sequence states, replaying a round
that rejected a draft, `engine/speculation.py`) and the compiled decode step is usable:
same refusals (`capture_refusal`), plus a family without a verify graph and a KV store
that changes what it stores without saying how (the rows must read their earlier rows'
K/V as the lone decode reads them back from the pool: float pages of the model's dtype,
or coded pages the store describes, whose rows the graph codes likewise). A model with
states gets them back as after the sequence's real rows, written and left for the runner
to commit, as the eager forward leaves them; the round is then rolled back as an eager
one is. A failure is logged once and the step is rerun eagerly, as for the decode step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from ninfer_core.engine.compiled_step import (
    DYNAMIC_ARGUMENTS,
    FIXED_ARGUMENTS,
    CompiledDecode,
    compile_graph,
    failure_reason,
    keeps_rows_as_read,
    own_code,
    page_table,
    state_args,
    write_states,
)

if TYPE_CHECKING:
    from ninfer_core.engine.sequence import Sequence
    from ninfer_core.kv.state import SequenceStatePool, StepStates
    from ninfer_core.model.attention_meta import AttentionMetadata

log = logging.getLogger(__name__)


def verify_refusal(model: torch.nn.Module, kv_store) -> str | None:
    """Why a round's forward of `model` over `kv_store` can't be captured, or None (given
    that the decode step can be: `capture_refusal`)."""
    if getattr(model, "verify_graph", None) is None:
        return "the model family offers no verify graph"
    if not keeps_rows_as_read(kv_store, model.dtype):
        return "the KV store does not keep K and V as computed (a lone decode reads them back)"
    return None


class CompiledVerify:
    """Runs a round's forward (up to `max_batch` decoding sequences, each padded to
    `width` rows) through the compiled `verify_graph`, one graph per batch size."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_store,
        block_size: int,
        width: int,
        max_batch: int = 1,
        states: SequenceStatePool | None = None,
    ) -> None:
        self.kv_store, self.block_size, self.width = kv_store, block_size, width
        #: The per-sequence states the graph reads and advances (None: a model without).
        self.states = states
        self.max_batch = max(1, min(max_batch, CompiledDecode.MAX_BATCH))
        # As the decode step's: the batch size and width static, the page count dynamic.
        self._fn = compile_graph(
            own_code(model.verify_graph), fixed=FIXED_ARGUMENTS, dynamic=DYNAMIC_ARGUMENTS
        )
        #: Why it stopped being used, once it failed; None while it works.
        self.failed: str | None = None
        #: Rounds the compiled function ran.
        self.steps = 0

    def takes(self, batch: Seq[tuple[Sequence, int]]) -> bool:
        """Whether this step is one it runs: every sequence runs at most `width` rows (its
        pending tokens and its drafts, or a short prompt's last tokens: every row is
        computed as a lone decode of it would be)."""
        return (
            self.failed is None
            and 0 < len(batch) <= self.max_batch
            and all(1 + len(seq.draft_ids) <= n <= self.width for seq, n in batch)
        )

    def run(
        self,
        batch: Seq[tuple[Sequence, int]],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        step: StepStates | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits [T, vocab] fp32, final hidden [T, hidden]) of the step's T rows in
        batch order, their K/V stored and the batch's next states written into `step`
        (for the caller to commit); None when the compiled function failed (the caller
        runs the step eagerly: nothing was written)."""
        w, bs = self.width, self.block_size
        counts = [n for _, n in batch]
        # Each sequence's rows, then copies of its last row up to the width.
        pad: list[int] = []
        real: list[int] = []
        start = 0
        for b, n in enumerate(counts):
            pad.extend(range(start, start + n))
            pad.extend([start + n - 1] * (w - n))
            real.extend(range(b * w, b * w + n))
            start += n
        index = torch.tensor(pad, dtype=torch.int64)
        ends = list(meta.context_lens)  # each sequence's context after its last row
        table = page_table(meta, ends, bs)
        context = torch.tensor([c - n + 1 for c, n in zip(ends, counts, strict=True)])
        args = (input_ids[index], positions[index], self.kv_store, table, context, w)
        try:
            logits, hidden, k, v, *states = self._fn(*args, *state_args(self.states, step))
        except Exception as exc:  # the compiler or its output, not the request
            self.failed = failure_reason(exc)
            log.warning("compiled verify step failed, verifying eagerly from now on: %s",
                        self.failed)  # fmt: skip
            return None
        if len(real) != len(pad):
            keep = torch.tensor(real, dtype=torch.int64)
            logits, hidden, k, v = logits[keep], hidden[keep], k[:, keep], v[:, keep]
        self.kv_store.write_layers(meta.slot_mapping, k, v)
        write_states(step, states)
        self.steps += 1
        return logits, hidden
