"""`n > 1`: one prompt, prefilled once, forked into `n` sequences that share its pages.

A request with `n` completions enters the queue as one sequence (it counts once against
`max_pending_requests`) whose `fan_out` is `n`. It prefills its prompt like any other; in
the step whose forward finishes the prompt, before anything is sampled, the engine forks it
(`fork`): each of the `n - 1` new sequences holds the prompt's full pages by reference (the
block manager's counts, as a prefix-cache hit does) and a copy of the partly filled last
page, and all `n` sample their first token from the same logits row, each with its own
random stream.

Why fork after the prompt rather than send `n` requests: the prefix cache shares only full
blocks that were computed before the next prompt is admitted, so `n` copies of one prompt
admitted together would each prefill it. A fork shares it by construction, whatever the
cache holds (or with `--no-prefix-cache`).

Why copy the partial last page rather than re-run its tokens in each fork: a raw page copy
(`KVStore.save_pages` / `load_pages`, the same one state snapshots use) gives each fork the
K/V bit for bit, costs no forward and keeps "the prompt is prefilled once" exact; re-running
would prefill up to `block_size - 1` tokens `n - 1` more times and give each fork its own
logits row. A store without those two functions gets `n > 1` refused rather than served
differently.

Why admission reserves everything up front: the prompt's full blocks once, and for each of
the `n` completions the rest of its `prompt + max_tokens` (its copy of the partial page
included), and `n` of the `max_concurrency` slots. So a fork never waits for pages or a
slot, and nothing is preempted, as for any other request (docs/engine.md).

Seeds follow vLLM's convention: completion `i` draws with `seed + i` (wrapped into the
seed range), so completion 0 is exactly what `n = 1` with the same seed gives, and a seeded
request gives the same `n` completions on every run.

A model with per-sequence state (hybrid state layers) forks its state too: each fork takes
a free slot of the state pool (admission counted `n` slots, and the pool has one per
concurrency slot) and gets a copy of the prompt's state (`SequenceStatePool.save` /
`restore`, as a state snapshot is resumed). Speculative decoding is refused with `n > 1`
for now: the drafter would have to be told of the new sequences (docs/serving.md).
"""

from __future__ import annotations

import dataclasses

import torch

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.sequence import Sequence, SequenceStatus
from ninfer_core.kv.state import SequenceStatePool
from ninfer_core.sampling import SamplingParams
from ninfer_core.sampling.params import SEED_BOUND


def fork_blocks(bm: BlockManager, seq: Sequence) -> int:
    """Pages the forks of `seq` will need beyond its own (0 when it is not to fork): for
    each of the `fan_out - 1` others, its prompt-plus-budget less the shared full blocks."""
    if seq.fan_out <= 1:
        return 0
    own = bm.blocks_for(seq.max_length) - seq.num_prompt_tokens // bm.block_size
    return (seq.fan_out - 1) * own


def family_blocks(bm: BlockManager, prompt_tokens: int, max_tokens: int, n: int) -> int:
    """Pages a request with `n` completions can ever hold: the prompt's full blocks once,
    and for each completion the rest of prompt plus `max_tokens`."""
    shared = prompt_tokens // bm.block_size
    return shared + n * (bm.blocks_for(prompt_tokens + max_tokens) - shared)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s sampling: the request's, with `seed + index` (vLLM's rule)."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    if seed >= SEED_BOUND:  # the generator takes seeds modulo 2**64: the same stream
        seed -= 2**64
    return dataclasses.replace(params, seed=seed)


def release(child: Sequence, bm: BlockManager, states: SequenceStatePool | None) -> None:
    """Give back what a fork holds (its pages, its state slot): a fork that failed, or the
    forks made before a later one failed."""
    bm.free(child)
    if child.state_slot is not None and states is not None:
        states.free(child.state_slot)


def fork(
    parent: Sequence, bm: BlockManager, kv_store, states: SequenceStatePool | None = None
) -> Sequence:
    """A new running sequence whose prompt K/V are `parent`'s: the full pages shared, the
    partial last page (if any) copied into a fresh page, and on a model with state layers
    `parent`'s state copied into a slot of its own. `parent` has just finished its prompt
    (nothing sampled yet) and its full blocks are committed."""
    if parent.completion_ids or parent.is_prefilling:
        raise ValueError(f"sequence {parent.seq_id} is not at the end of its prompt")
    child = Sequence(
        parent.token_ids,
        max_tokens=parent.max_tokens,
        deadline=parent.deadline,
        cache_salt=parent.cache_salt,
    )
    child.enqueued_at = parent.enqueued_at
    child.prompt_hashes = parent.prompt_hashes
    child.num_cached_tokens = parent.num_cached_tokens
    try:
        partial = bm.share_prompt(parent, child)
        if partial is not None:
            source, target = partial
            device = kv_store.device
            saved = kv_store.save_pages(torch.tensor([source], device=device))
            kv_store.load_pages(torch.tensor([target], device=device), saved)
        if states is not None:
            child.state_slot = states.allocate()
            states.restore(child.state_slot, states.save(parent.state_slot))
            child.state_position = parent.state_position
    except Exception:  # nothing of a half-made fork stays held
        release(child, bm, states)
        raise
    child.num_computed_tokens = parent.num_computed_tokens
    child.status = SequenceStatus.RUNNING
    return child


def can_fork(kv_store) -> bool:
    """Whether the store can copy a page (what a fork of a partial last block needs)."""
    return getattr(kv_store, "save_pages", None) is not None and (
        getattr(kv_store, "load_pages", None) is not None
    )
