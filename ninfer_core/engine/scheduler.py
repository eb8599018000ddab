"""`Scheduler`: which sequences run this step, and how many tokens each (policy only).

It sees `Sequence`s and the `BlockManager`'s page counts, never a tensor. Per step:

1. queued sequences past their deadline leave the queue (the engine fails them);
2. admission, in turn (`next_in_turn`): the lowest `priority`, then the tenant (API key)
   with the fewest slots running, then the one admitted least recently, then the longest
   waiting, so keys take turns and one key's flood of requests cannot keep another's out.
   That sequence starts when a slot is free and its prompt plus `max_tokens` fits the
   pages nobody has claimed (free + idle cached, less the pages the running sequences may
   still need); it is never overtaken, so a long prompt is not starved by short ones;
3. the batch: one decode token for every running sequence past its prompt, then prefill
   chunks of the running prompts, oldest first, in what is left of the `prefill_chunk` token
   budget. A running stream therefore gets a token every step, however long the prompt being
   prefilled beside it; and while any sequence decodes, prefill is paced on the clock
   (`pacing.py`), so that the steps stay short and the streams keep a share of the time.

Reserving `max_tokens` at admission means a running sequence never runs out of pages, so
nothing is ever preempted or recomputed. A model with state layers also needs a free slot
of the per-sequence state pool to admit a sequence; the slot is zeroed when taken and given
back when the sequence ends, however it ends. Its prefix cache hits are state snapshots
(`state_snapshots.py`): a sequence resumes from one at admission, prefill chunks end where
one is wanted, and one is taken when a sequence ends, before its slot goes back.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.fanout import fork_blocks
from ninfer_core.engine.pacing import PrefillPacing
from ninfer_core.engine.sequence import Sequence, SequenceStatus
from ninfer_core.engine.state_snapshots import StateSnapshots
from ninfer_core.kv.state import SequenceStatePool

#: The derived pending timeout (`pending_timeout_ms = 0`) is this many times the estimated wait,
#: and never less than MIN_PENDING_TIMEOUT_S: prefill slows as the context grows, and
#: `max_tokens` is only a bound, so the estimate is rough; failing a request that would have
#: run is worse than letting it wait.
PENDING_TIMEOUT_FACTOR = 3.0
MIN_PENDING_TIMEOUT_S = 60.0


@dataclass
class SchedulerOutput:
    #: (sequence, new tokens to run): decodes first, then prefill chunks.
    batch: list[tuple[Sequence, int]] = field(default_factory=list)
    #: Queued sequences whose deadline passed; already out of the queue.
    expired: list[Sequence] = field(default_factory=list)
    #: Sequences that left the queue and started this step.
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for seq, _ in self.batch if not seq.is_prefilling)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for seq, n in self.batch if seq.is_prefilling)


class StepCosts:
    """Running averages of what a step costs: seconds per prefill token, per decode step.

    Before the first measurement they are deliberately slow guesses (a small GPU on a long
    prompt), so that a derived timeout errs long.
    """

    PRIOR_PREFILL_TOKEN_S = 1 / 100
    PRIOR_DECODE_STEP_S = 0.1
    SMOOTHING = 0.2

    def __init__(self) -> None:
        self.prefill_token_s = self.PRIOR_PREFILL_TOKEN_S
        self.decode_step_s = self.PRIOR_DECODE_STEP_S
        self._measured = {"prefill": False, "decode": False}

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step's duration. A step with a prefill is charged wholly to its prefill
        tokens (a slight overestimate, the safe side)."""
        if prefill_tokens:
            self._update("prefill", "prefill_token_s", seconds / prefill_tokens)
        elif decode_tokens:
            self._update("decode", "decode_step_s", seconds)

    def _update(self, kind: str, name: str, sample: float) -> None:
        old = getattr(self, name)
        new = sample if not self._measured[kind] else old + self.SMOOTHING * (sample - old)
        self._measured[kind] = True
        setattr(self, name, new)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        states: SequenceStatePool | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.states = states
        #: The prefix cache of a model with state layers (None: off, or no state layers).
        self.snapshots = snapshots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.costs = StepCosts()
        self.pacing = PrefillPacing(config.decode_share)
        #: Admissions so far, and each tenant's latest: whose turn it is (`next_in_turn`).
        self._admissions = 0
        self._last_admitted: dict[str | None, int] = {}

    def __iter__(self) -> Iterator[Sequence]:
        """Every live sequence, running then waiting."""
        yield from self.running
        yield from self.waiting

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- queue -----------------------------------------------------------------------------

    def add(
        self, seq: Sequence, now: float, deadline: float | None, timeout_s: float | None
    ) -> None:
        """Queue `seq` until `deadline`, else `timeout_s` from now, else the configured or
        derived pending timeout (`default_deadline`)."""
        if deadline is None:
            deadline = self.default_deadline(now) if timeout_s is None else now + timeout_s
        seq.status, seq.enqueued_at, seq.deadline = SequenceStatus.WAITING, now, deadline
        self.waiting.append(seq)

    def next_in_turn(self) -> Sequence:
        """The waiting sequence admission considers next: the lowest priority, then the
        tenant holding the fewest running slots, then the one admitted least recently (so
        tenants take turns even when one slot frees at a time), then the first to arrive."""
        if len(self.waiting) == 1:
            return self.waiting[0]
        held: Counter[str | None] = Counter()
        for s in self.running:
            held[s.tenant] += s.fan_out
        last = self._last_admitted

        def turn(item: tuple[int, Sequence]) -> tuple[int, int, int, int]:
            at, seq = item
            return (seq.priority, held[seq.tenant], last.get(seq.tenant, -1), at)

        return min(enumerate(self.waiting), key=turn)[1]

    def waiting_of(self, tenant: str) -> int:
        """Sequences of `tenant` in the queue."""
        return sum(1 for s in self.waiting if s.tenant == tenant)

    def queue_length_with_one_more(self) -> int:
        """How many would wait if one more request came now, once free slots take theirs:
        the number `max_pending_requests` bounds."""
        free_slots = max(0, self.config.max_concurrency - self.slots_in_use)
        return max(0, len(self.waiting) + 1 - free_slots)

    @property
    def slots_in_use(self) -> int:
        """Concurrency slots the running sequences hold: one each, and a prompt that will
        fork into `n` (`engine/fanout.py`) holds its forks' already."""
        return sum(s.fan_out for s in self.running)

    def adopt(self, parent: Sequence, forks: list[Sequence]) -> None:
        """Run `forks` of `parent` (already running, holding their pages) from now on,
        in the slots `parent` reserved for them."""
        at = self.running.index(parent) + 1
        self.running[at:at] = forks
        parent.fan_out = 1

    def remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence) -> None:
        """A running sequence ends (stop, length, cancel, error): its pages go back now.
        (The engine has already snapshotted a sound state: copying tensors is not this
        policy's work.)"""
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if self.snapshots is not None:
            self.snapshots.forget(seq)
        self.block_manager.free(seq)
        if seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def default_deadline(self, now: float) -> float:
        """When a request queued now times out, if neither it nor the config says."""
        if self.config.pending_timeout_ms:
            return now + self.config.pending_timeout_ms / 1000
        wait = self.estimate_wait()
        return now + max(MIN_PENDING_TIMEOUT_S, PENDING_TIMEOUT_FACTOR * wait)

    # -- estimates -------------------------------------------------------------------------

    def _remaining_s(self, seq: Sequence) -> float:
        prefill = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        decode = seq.max_tokens - len(seq.completion_ids)
        return prefill * self.costs.prefill_token_s + decode * self.costs.decode_step_s

    def estimate_wait(self) -> float:
        """Seconds until a request queued now would start: the work of everything ahead of
        it, with decode steps shared by `max_concurrency` sequences at a time."""
        if not self.waiting and self.slots_in_use < self.config.max_concurrency:
            return 0.0
        costs, ahead = self.costs, [*self.running, *self.waiting]
        prefill = sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in ahead)
        decode = sum(s.max_tokens - len(s.completion_ids) for s in ahead)
        return (
            prefill * costs.prefill_token_s
            + decode * costs.decode_step_s / self.config.max_concurrency
        )

    def estimate_retry_after(self) -> float:
        """Seconds until a place in the queue frees up: the soonest running sequence's end."""
        return min((self._remaining_s(s) for s in self.running), default=0.0)

    # -- one step --------------------------------------------------------------------------

    def observe(self, plan: SchedulerOutput, seconds: float) -> None:
        """How long `plan`'s batch took to run: the estimates and the pacing learn from it."""
        prefill, decode = plan.num_prefill_tokens, plan.num_decode_tokens
        self.costs.observe(prefill, decode, seconds)
        self.pacing.observe(prefill, decode, seconds)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        for seq in [s for s in self.waiting if s.deadline is not None and now >= s.deadline]:
            self.remove_waiting(seq)
            out.expired.append(seq)
        while self.waiting:
            seq = self.next_in_turn()
            if self.slots_in_use + seq.fan_out > self.config.max_concurrency:
                break
            if not self._fits(seq):
                break
            self.waiting.remove(seq)
            self._admissions += 1
            self._last_admitted[seq.tenant] = self._admissions
            if self.states is None:
                self.block_manager.admit(seq, max_blocks=0 if seq.embedding else None)
            else:  # a block hit alone would lack the state: only snapshots resume
                seq.state_slot = self.states.allocate()
                if self.snapshots is not None and not seq.embedding:
                    self.snapshots.admit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
        out.batch = self._batch()
        return out

    def _reserved_blocks(self) -> int:
        """Pages the running sequences may still claim, up to prompt plus `max_tokens`."""
        bm = self.block_manager
        return sum(
            max(0, bm.blocks_for(s.max_length) - len(s.block_table)) + fork_blocks(bm, s)
            for s in self.running
        )

    def _fits(self, seq: Sequence) -> bool:
        if self.states is not None and self.states.num_free < seq.fan_out:
            return False
        bm = self.block_manager
        hits = idle_hits = 0
        if seq.embedding:  # every token runs (`engine/pooling.py`)
            pass
        elif self.states is None:
            hits, idle_hits = bm.match_prefix(seq)
        elif self.snapshots is not None and (hit := self.snapshots.match(seq)) is not None:
            hits, idle_hits = hit.blocks, hit.idle
        # Idle hits stop being evictable once taken, so they leave the unclaimed count.
        unclaimed = bm.num_free_blocks - idle_hits - self._reserved_blocks()
        need = bm.blocks_for(seq.max_length) - hits + fork_blocks(bm, seq)
        return need <= unclaimed

    def _batch(self) -> list[tuple[Sequence, int]]:
        # A decoding sequence runs its pending tokens (one, or the accepted tokens of a
        # round a state model replays, `engine/speculation.py`) plus the drafts it verifies.
        decode = [
            (s, s.num_pending_tokens + len(s.draft_ids))
            for s in self.running
            if not s.is_prefilling
        ]
        # Decodes come first; a prompt still gets a block's worth when decodes fill the
        # budget, so it is never starved by a full house of streams (once the pacing's
        # debt is paid).
        chunk = self.config.prefill_chunk
        decode_tokens = sum(n for _, n in decode)
        floor = min(chunk, self.config.block_size)
        budget = self.pacing.prefill_tokens(bool(decode), max(chunk - decode_tokens, floor), floor)
        prefill = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq.is_prefilling:
                n = min(seq.num_pending_tokens, budget)
                if self.snapshots is not None:
                    n = self.snapshots.chunk(seq, n)
                prefill.append((seq, n))
                budget -= n
        return decode + prefill
