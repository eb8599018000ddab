"""The speculation glue of a step: what the drafter is told after a forward, and the
periodic summary of how well its drafts are accepted.

The drafting policy itself (budgets, rounds, verification) lives in `speculation.py`; this
module holds what the engine does with it around each step, so the step itself stays three
verbs. Both pieces take what they need explicitly: the engine's `drafter`, `spec_name` and
`spec_options` stay plain attributes a test may set.
"""

from __future__ import annotations

import dataclasses
import logging

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.model_runner import StepForward
from ninfer_core.engine.sequence import Sequence, SequenceStatus
from ninfer_core.engine.speculation import draft_input, kept_end, max_drafts
from ninfer_core.spec.stats import SpecCounters
from ninfer_core.spec.types import DraftInput

#: The periodic speculation summary (`ninfer-serve` shows it without `-v`).
spec_log = logging.getLogger("ninfer_core.spec")
#: Seconds between two speculation summaries in the log, as vLLM's stats interval.
SPEC_LOG_INTERVAL_S = 10.0


def draft_inputs(
    batch: list[tuple[Sequence, int]],
    output: StepForward,
    starts: dict[int, int],
    accepted: dict[int, int],
    k: int,
    block_manager: BlockManager,
) -> tuple[list[Sequence], list[DraftInput]]:
    """What the drafter learns of each sequence that ran and still runs; each one that
    will draft (up to `k` tokens) gets the pages of its lookahead now (reserved at
    admission, so this allocation cannot fail for want of pages)."""
    seqs, inputs, offset = [], [], 0
    for seq, n in batch:
        if seq.status is SequenceStatus.RUNNING:
            budget = max_drafts(seq, k)
            if budget:
                block_manager.allocate(seq, seq.num_pending_tokens + budget)
            item = draft_input(
                seq, starts[seq.seq_id], kept_end(seq), offset, output.hidden, budget,
                accepted.get(seq.seq_id),
            )  # fmt: skip
            seqs.append(seq)
            inputs.append(item)
        offset += n
    return seqs, inputs


class SpecLog:
    """Every `SPEC_LOG_INTERVAL_S`, one line on the rounds since the last (vLLM's figures:
    acceptance rate, mean tokens per round, acceptance by position), so an operator sees
    how speculation pays without turning on debug logging."""

    def __init__(self, now: float) -> None:
        self._logged_at = now
        self._logged = SpecCounters()

    def maybe_log(self, now: float, total: SpecCounters, spec_name: str | None) -> None:
        if now - self._logged_at < SPEC_LOG_INTERVAL_S:
            return
        last = self._logged
        rounds, drafted = total.rounds - last.rounds, total.drafted - last.drafted
        if rounds:
            accepted = total.accepted - last.accepted
            old = last.accepted_per_pos + [0] * len(total.accepted_per_pos)
            by_pos = [(n - o) / rounds for n, o in zip(total.accepted_per_pos, old, strict=False)]
            spec_log.info(
                "speculation (%s): %d rounds, acceptance %.1f%% (%d of %d drafts), "
                "%.2f tokens per round, by position %s",
                spec_name, rounds, 100 * accepted / drafted, accepted, drafted,
                1 + accepted / rounds, " ".join(f"{r:.2f}" for r in by_pos),
            )  # fmt: skip
        # A copy: the totals go on counting in place.
        self._logged = dataclasses.replace(total, accepted_per_pos=list(total.accepted_per_pos))
        self._logged_at = now
