"""The prefix cache and the block manager's bookkeeping, alone and under a running engine.

The unit tests drive a `BlockManager` by hand; the engine tests use the same tiny fp32 Qwen3
as test_engine_scheduling.py (hidden 64, 2 layers, block size 16) and check every output
against a cold run, so a page handed to the wrong sequence shows up as a wrong token.
"""

from __future__ import annotations

import contextlib
import random
import time

import pytest
from engine_helpers import computed, prompt, tiny_engine

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.prefix_cache import chain_hashes
from ninfer_core.engine.request import FinishEvent, GenerationRequest, OverloadedError
from ninfer_core.engine.sequence import Sequence
from ninfer_core.sampling import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def request(ids: list[int], max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(ids, GREEDY, max_tokens=max_tokens, ignore_eos=True)


# --------------------------------------------------------------------------
# BlockManager by hand
# --------------------------------------------------------------------------


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(8, BLOCK, enable_prefix_cache=True, salt="kv-codec=fp32")
    shared = prompt(48, seed=1)
    a = computed(bm, [*shared, 1, 2])
    b = Sequence([*shared, 3, 4, 5])
    assert bm.match_prefix(b) == (3, 0)  # three full blocks, all held by `a`
    assert bm.admit(b) == 48 and b.block_table == a.block_table[:3]
    bm.check_invariants([a, b])
    bm.free(a)
    bm.check_invariants([b])  # b still holds the shared three: nothing idle yet
    # a's fourth page held 2 tokens, never a full block: it goes back to the free list
    assert bm.cache.num_idle == 0 and bm.num_free_blocks == 8 - 3
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 3


def test_a_whole_cached_prompt_still_leaves_one_token_to_compute():
    bm = BlockManager(8, BLOCK, enable_prefix_cache=True)
    ids = prompt(48, seed=2)
    bm.free(computed(bm, ids))
    again = Sequence(ids)
    assert bm.admit(again) == 32 and again.num_pending_tokens == 16


def test_salt_separates_pools_and_off_means_off():
    ids = prompt(40, seed=3)
    fp32 = BlockManager(8, BLOCK, enable_prefix_cache=True, salt="kv-codec=fp32")
    fp16 = BlockManager(8, BLOCK, enable_prefix_cache=True, salt="kv-codec=fp16")
    assert fp32.cache.root != fp16.cache.root
    keys = [chain_hashes(ids, BLOCK, bm.cache.root) for bm in (fp32, fp16)]
    assert len(keys[0]) == 2 and not set(keys[0]) & set(keys[1])
    # Equal blocks after different prefixes get different keys: the chain is over prefixes.
    a, b = [*ids[:16], *ids[16:32]], [*ids[16:32], *ids[16:32]]
    assert chain_hashes(a, BLOCK, fp32.cache.root)[1] != chain_hashes(b, BLOCK, fp32.cache.root)[1]
    off = BlockManager(8, BLOCK)
    off.free(computed(off, ids))
    assert off.match_prefix(Sequence(ids)) == (0, 0) and off.num_cached_blocks == 0


def test_eviction_takes_idle_blocks_lru_tail_first_never_held_ones():
    bm = BlockManager(6, BLOCK, enable_prefix_cache=True)
    old, new = prompt(32, seed=4), prompt(32, seed=5)
    probe = Sequence([*old, 0])
    bm.free(computed(bm, old))  # old's two pages go idle, its tail released first
    held = computed(bm, new)  # two free pages
    assert len(bm._free) == 2 and bm.cache.num_idle == 2 and bm.num_free_blocks == 4
    grower = Sequence(prompt(16, seed=6))
    bm.allocate(grower, 32)  # the free list first
    assert bm.match_prefix(probe) == (2, 2)
    bm.allocate(grower, 48)  # then the idle page released longest ago: old's tail
    assert bm.match_prefix(probe) == (1, 1)
    bm.allocate(grower, 64)
    assert bm.match_prefix(probe) == (0, 0)
    assert not set(grower.block_table) & set(held.block_table)
    assert bm.match_prefix(Sequence([*new, 0])) == (2, 0)  # held pages were never taken
    bm.check_invariants([held, grower])
    assert not bm.can_allocate(grower, 80)


def test_check_invariants_catches_a_double_free_and_a_leak():
    bm = BlockManager(4, BLOCK)
    seq = Sequence(range(20))
    bm.allocate(seq, 20)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    bm._refs[table[0]] = 1  # pretend it is held again, but its page also sits on the free list
    with pytest.raises(AssertionError, match="free page"):
        bm.check_invariants([seq])
    leak = BlockManager(4, BLOCK)
    lost = Sequence(range(20))
    leak.allocate(lost, 20)
    with pytest.raises(AssertionError, match="ref count 1, 0 holders"):
        leak.check_invariants([])  # `lost` forgotten without a free


# --------------------------------------------------------------------------
# Under the engine
# --------------------------------------------------------------------------


@pytest.fixture
def make_engine(engine_model):
    def make(**config) -> Engine:
        return tiny_engine(engine_model, **{"block_size": BLOCK, **config})

    return make


def test_shared_three_block_prefix_is_reused(make_engine):
    shared = prompt(3 * BLOCK, seed=7)
    first, second = [*shared, *prompt(9, seed=8)], [*shared, *prompt(13, seed=9)]
    cold = make_engine(prefix_cache=False)
    want = cold.generate([request(second, 16)])[0]
    assert want.finish.usage.cached_tokens == 0 and cold.counters.prefill_tokens == len(second)

    engine = make_engine(prefill_chunk=20)
    engine.generate([request(first, 16)])
    before = engine.counters.prefill_tokens
    got = engine.generate([request(second, 16)])[0]
    assert got.finish.usage.cached_tokens >= 3 * BLOCK
    assert engine.counters.prefill_tokens - before == len(second) - 3 * BLOCK
    assert got.token_ids == want.token_ids
    engine.check_invariants()


def test_running_sequences_share_blocks_as_they_fill(make_engine):
    """The second request arrives while the first still runs and takes its full blocks."""
    shared = prompt(40, seed=10)
    a, b = [*shared, *prompt(5, seed=11)], [*shared, *prompt(7, seed=12)]
    want = [make_engine(prefix_cache=False).generate([request(p, 20)])[0].token_ids
            for p in (a, b)]  # fmt: skip
    engine = make_engine(max_concurrency=2, prefill_chunk=16)
    ra = engine.add(request(a, 20))
    for _ in range(4):
        engine.step()
    rb = engine.add(request(b, 20))
    engine.step()
    live = {s.seq_id: s for s in engine.scheduler.running}
    tables = [s.block_table for s in live.values()]
    assert tables[0][:2] == tables[1][:2]  # 40 shared tokens: two full blocks, one page each
    engine.check_invariants()
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert [ra.token_ids, rb.token_ids] == want
    assert rb.finish.usage.cached_tokens == 32


def test_eviction_under_pressure_never_frees_a_referenced_block(make_engine):
    """A 12-page pool, three at a time, prompts over a few shared prefixes: pages are evicted
    and reused all the time; every output must still equal its cold run."""
    prefixes = [prompt(n, seed=20 + n) for n in (16, 33, 48)]
    prompts = [[*prefixes[i % 3][: 16 * (1 + i % 3)], *prompt(3 + i, seed=40 + i)]
               for i in range(15)]  # fmt: skip
    cold = make_engine(prefix_cache=False, kv_capacity=128, max_concurrency=1)
    want = [r.token_ids for r in cold.generate([request(p) for p in prompts])]
    engine = make_engine(kv_capacity=12 * BLOCK, max_concurrency=3, max_pending_requests=20,
                         prefill_chunk=24)  # fmt: skip
    bm, evicted = engine.block_manager, []
    evict = bm.cache.evict

    def checked_evict() -> int:
        block = evict()
        assert bm._refs[block] == 0, f"evicted page {block} is held"
        evicted.append(block)
        return block

    bm.cache.evict = checked_evict
    results = [engine.add(request(p)) for p in prompts]
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert [r.token_ids for r in results] == want
    assert len(evicted) > 5
    assert sum(r.finish.usage.cached_tokens for r in results) > 0


def random_session(make_engine, rng: random.Random, steps: int) -> list:
    """Random submissions (over shared prefixes, random lengths and limits), cancels and
    steps on one engine with a random configuration, checked after every step."""
    engine = make_engine(
        kv_capacity=rng.choice([10, 20, 40]) * BLOCK, max_concurrency=rng.choice([1, 2, 4]),
        max_pending_requests=rng.choice([0, 2, 6]), prefill_chunk=rng.choice([5, 16, 30, 64]),
        prefix_cache=rng.random() < 0.8, max_context=160,
    )  # fmt: skip
    prefixes = [prompt(64, seed=rng.randrange(1000)) for _ in range(3)]
    results = []
    for _ in range(steps):
        action = rng.random()
        if action < 0.3:
            head = rng.choice(prefixes)[: rng.randrange(0, 64)]
            ids = [*head, *(rng.randrange(3, 400) for _ in range(rng.randrange(1, 40)))]
            with contextlib.suppress(OverloadedError):
                results.append(engine.add(request(ids, rng.randrange(1, 30))))
        elif action < 0.4 and results:
            engine.cancel(rng.choice(results).request_id)
        else:
            engine.step()
            engine.check_invariants()
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    return results


def test_random_submit_cancel_finish_keeps_invariants(make_engine):
    """Bounded in time: as many random sessions as fit in about five seconds."""
    rng, results, sessions = random.Random(1234), [], 0
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and sessions < 40:
        results += random_session(make_engine, rng, steps=300)
        sessions += 1
    finishes = [[e for e in r.events if isinstance(e, FinishEvent)] for r in results]
    assert all(len(f) == 1 for f in finishes)  # every request ended exactly once
    reasons = {f[0].reason for f in finishes}
    assert {"length", "cancelled"} <= reasons and "error" not in reasons and sessions >= 3
