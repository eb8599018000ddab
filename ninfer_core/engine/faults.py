"""Pinning a failed step on the sequences that caused it, so one request cannot end others.

A step runs every scheduled sequence in one forward, so one sequence that breaks the model
(a corrupt token id, a shape the kernels refuse, NaN from its own activations) used to fail
the whole batch, and every other client's stream ended with the same error. The faults are
almost always in one sequence's own data: in a varlen batch the sequences share weights and
kernels, never values, so what fails on a sequence in a batch fails on it alone and what works
alone also works beside others.

Two places can trace a fault to a sequence:

- **the forward** (`run_isolated`): when the batch raises, each sequence is run again alone;
  the ones that raise again end with the error, the others go on with their logits. Re-running
  is safe: the only sequence state a forward advances, `num_computed_tokens`, is put back
  after a failure; K/V the failed forward wrote lie past each sequence's computed tokens and
  are written again; the pages it allocated were reserved at admission anyway. One by one,
  not by bisection: the retries together cost exactly one more pass over the step's tokens
  (bisection recomputes them up to log2(B) times), and a step only fails on a bug or a device
  fault, so the retry path need not be fast. A batch of one is not retried: alone is how it
  already ran. A device that is really broken fails every retry, and every request ends as
  before; a transient fault (an allocation a smaller batch does not need) costs nobody.
- **the logits** (`unusable_rows`): a row with no finite value (all NaN, say, from a
  sequence whose activations overflowed) has nothing to sample from; its request ends with an
  error instead of streaming the sampler's fallback token.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ninfer_core.engine.model_runner import StepForward
from ninfer_core.engine.sequence import Sequence

log = logging.getLogger("ninfer_core.engine.engine")
Batch = list[tuple[Sequence, int]]


@dataclass
class IsolatedRun:
    """What a step's forward produced: the sequences that ran, their output, and the failures."""

    #: (sequence, tokens run) that succeeded, in batch order; `output` holds their rows.
    ok: Batch
    #: The forward of `ok` (logits rows in batch order), or None when nothing succeeded.
    output: StepForward | None
    #: (sequence, the exception its forward raised), in batch order.
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)
    #: The batch failed and was re-run one by one (its timing is no fair cost sample then).
    retried: bool = False


def run_isolated(run: Callable[[Batch], StepForward], batch: Batch) -> IsolatedRun:
    """`run(batch)`; if it raises, `run([item])` for each item, keeping what works alone."""
    # What a forward may advance; put back after a failure, so that a retry (and the next
    # step) starts from the same tokens whatever point the failed forward reached.
    computed = [seq.num_computed_tokens for seq, _ in batch]
    try:
        return IsolatedRun(list(batch), run(batch))
    except Exception as exc:
        log.exception("engine step failed")
        for (seq, _), n in zip(batch, computed, strict=True):
            seq.num_computed_tokens = n
        if len(batch) == 1:
            return IsolatedRun([], None, [(batch[0][0], exc)])
    ok: Batch = []
    parts: list[StepForward] = []
    failed: list[tuple[Sequence, Exception]] = []
    for item, n in zip(batch, computed, strict=True):
        try:
            parts.append(run([item]))
        except Exception as exc:
            item[0].num_computed_tokens = n
            log.error(
                "sequence %d fails alone too: %s: %s", item[0].seq_id, type(exc).__name__, exc
            )
            failed.append((item[0], exc))
        else:
            ok.append(item)
    if ok:
        log.warning("the step's failure is pinned on %d of %d sequences", len(failed), len(batch))
    output = StepForward.cat(parts) if parts else None
    return IsolatedRun(ok, output, failed, retried=True)


def unusable_rows(logits: torch.Tensor) -> list[bool]:
    """logits: [B, V] -> per row, whether it holds no finite value at all (nothing to sample).

    A row's max is finite only if the row has no NaN (max propagates it), no +inf and some
    finite value, so one max per row (~0.1 ms for 16 x 152k on a CPU core) clears the usual
    step; only rows whose max is not finite get the full check (`isfinite` over a whole
    [16, 152k] batch costs ~10 ms).
    """
    # The maxima checked on the host: two tensor ops per step, not five (each costs
    # microseconds on the CPU, paid on every decode step of every request).
    row_max = logits.amax(dim=-1).tolist()
    suspect = [i for i, m in enumerate(row_max) if not math.isfinite(m)]
    dead = [False] * logits.shape[0]
    if suspect:
        rows = torch.isfinite(logits[suspect]).any(dim=-1).tolist()
        for i, usable in zip(suspect, rows, strict=True):
            dead[i] = not usable
    return dead
