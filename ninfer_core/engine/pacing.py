"""`PrefillPacing`: how much prefill a step may take while other sequences decode.

Every step runs one token for each decoding sequence and then prefill chunks in what is
left of the `prefill_chunk` budget (`scheduler.py`). Left at that, a stream decoding beside
a long prompt, or beside a flood of embedding inputs (prefill only), gets one token per
step while each step takes as long as a 1,024-token prefill: on a CPU that is a token a
second instead of a hundred. So while any sequence decodes, prefill is paced on the clock:

- **a share of the time.** Prefill may take at most `1 - decode_share` of the engine's time
  (`--decode-share`, default 0.5): the time a step spent beyond a decode step is owed, and
  steps that only decode pay it back. A stream therefore keeps at least about
  `decode_share` of the rate it has alone, whatever arrives beside it.
- **short stalls.** One step's prefill is cut to about `STALL_STEPS` decode steps' time, so
  the gaps between a stream's tokens stay a few steps long rather than one long prefill.

When nothing decodes, prefill takes the whole budget, as before: pacing costs a lone prompt
nothing. The costs are measured (running averages of the steps' own durations), so the
same rule holds on a GPU and on a CPU. A prompt is never starved: each step with no debt
runs at least a block of it.
"""

from __future__ import annotations

#: One step's prefill is cut to about this many decode steps' time while streams decode.
STALL_STEPS = 4.0


class PrefillPacing:
    """The time prefill owes the decoding streams, and the prefill tokens a step may take."""

    SMOOTHING = 0.2

    def __init__(self, decode_share: float) -> None:
        if not 0.0 <= decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), got {decode_share}")
        self.decode_share = decode_share
        #: Seconds of prefill not yet paid back by decode time (scaled by the share).
        self.debt_s = 0.0
        #: Running averages: one decode step, and one prefill token beyond it.
        self.decode_step_s: float | None = None
        self.prefill_token_s: float | None = None

    @property
    def on(self) -> bool:
        return self.decode_share > 0.0

    def prefill_tokens(self, decoding: bool, budget: int, floor: int) -> int:
        """Prefill tokens this step may run, of `budget`; `floor` (a block) when it may run
        any, so that a prompt always moves once the debt is paid."""
        if not decoding or not self.on:
            return budget
        if self.debt_s > 0.0:
            return 0
        if self.decode_step_s is None or self.prefill_token_s is None:
            return min(budget, floor)  # nothing measured yet: a block, then measure
        stall = STALL_STEPS * self.decode_step_s
        return min(budget, max(floor, int(stall / max(self.prefill_token_s, 1e-9))))

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step's duration, after it ran."""
        if decode_tokens and not prefill_tokens:
            self.decode_step_s = self._average(self.decode_step_s, seconds)
        if prefill_tokens:  # beyond a step's fixed cost, which a decode step measures
            extra = max(0.0, seconds - (self.decode_step_s or 0.0))
            self.prefill_token_s = self._average(self.prefill_token_s, extra / prefill_tokens)
        if not decode_tokens or not self.on:
            self.debt_s = 0.0  # nothing was waiting on this step's prefill
            return
        # Prefill time is owed; decode time pays it back at decode_share : 1 - decode_share.
        decode_part = seconds if not prefill_tokens else min(seconds, self.decode_step_s or 0.0)
        prefill_part = seconds - decode_part
        repay = decode_part * (1.0 - self.decode_share) / self.decode_share
        self.debt_s = max(0.0, self.debt_s + prefill_part - repay)

    def _average(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.SMOOTHING * (sample - old)
