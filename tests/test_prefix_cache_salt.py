"""A cache salt splits the prefix cache: equal salts share blocks, different ones never do.

The issue's side channel: with one shared cache, `cached_tokens` told a client whether anyone
else had sent a prompt (64 on a right guess, 16 on a wrong one). With salts from the API key,
a guess under another key always reads 0. The engine tests use the tiny fp32 Qwen3 of the
other engine tests and check the tokens against a run with the cache off, so a page shared
across salts (or a salted chain that lost its own pages) would show as a wrong token too.
"""

from __future__ import annotations

import pytest
from engine_helpers import computed, prompt, tiny_engine

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.prefix_cache import chain_hashes, salted_root
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sequence import Sequence
from ninfer_core.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


def test_salted_roots_differ_from_each_other_and_from_the_pool_root():
    root = BlockManager(4, BLOCK, enable_prefix_cache=True, salt="kv-codec=fp32").cache.root
    roots = {salted_root(root, s) for s in ("a", "b", "tenant-1", "ü", "\udcff")}
    assert len(roots) == 5 and root not in roots
    assert salted_root(root, None) == root and salted_root(root, "a") == salted_root(root, "a")
    ids = prompt(48, seed=1)
    keys = {s: chain_hashes(ids, BLOCK, salted_root(root, s)) for s in (None, "a", "b")}
    assert not set(keys[None]) & set(keys["a"]) and not set(keys["a"]) & set(keys["b"])


@pytest.mark.parametrize(
    ("first", "second", "hits"),
    [("a", "a", 2), ("a", "b", 0), (None, "a", 0), ("a", None, 0), (None, None, 2)],
)
def test_block_manager_shares_only_within_a_salt(first, second, hits):
    bm = BlockManager(8, BLOCK, enable_prefix_cache=True, salt="kv-codec=fp32")
    ids = prompt(40, seed=2)
    held = computed(bm, ids, first)
    other = Sequence(ids, cache_salt=second)
    assert bm.match_prefix(other)[0] == hits
    bm.admit(other)
    assert len(set(other.block_table) & set(held.block_table)) == hits
    bm.check_invariants([held, other])
    bm.free(held)
    bm.free(other)
    bm.check_invariants([])


@pytest.fixture
def engine(engine_model):
    return tiny_engine(engine_model, clock=lambda: 0.0, max_concurrency=2)


def request(ids: list[int], salt: str | None) -> GenerationRequest:
    return GenerationRequest(ids, GREEDY, max_tokens=6, ignore_eos=True, cache_salt=salt)


def test_same_prompt_different_salt_reads_zero_cached_tokens(engine, engine_model):
    ids = prompt(70, seed=3)  # 4 full blocks; at most all but the last token can match
    cold = tiny_engine(engine_model, clock=lambda: 0.0, prefix_cache=False)
    want = cold.generate([request(ids, None)])[0].token_ids
    runs = [("tenant-a", 0), ("tenant-b", 0), (None, 0), ("tenant-a", 64), ("tenant-b", 64)]
    for salt, cached in runs:
        result = engine.generate([request(ids, salt)])[0]
        assert result.finish.usage.cached_tokens == cached, salt
        assert result.token_ids == want, salt
        engine.check_invariants()


def test_running_requests_with_different_salts_hold_no_page_in_common(engine):
    ids = prompt(50, seed=4)
    same = [engine.add(request(ids, "k")), engine.add(request(ids, "k"))]
    engine.generate([])  # run both to the end
    assert [r.finish.usage.cached_tokens for r in same] == [0, 0]  # prefilled side by side
    a = engine.add(request(ids, "k"))
    b = engine.add(request(ids, "other"))
    engine.step()  # both admitted and prefilling
    tables = [engine._live[r.request_id].seq.block_table for r in (a, b)]
    assert tables[0] and tables[1] and not set(tables[0]) & set(tables[1])
    engine.check_invariants()
    engine.generate([])
    assert a.finish.usage.cached_tokens == 48 and b.finish.usage.cached_tokens == 0
    assert a.token_ids == b.token_ids == same[0].token_ids


@pytest.mark.parametrize("bad", ["", 3, b"x"])
def test_a_cache_salt_must_be_a_non_empty_string(bad):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string or None"):
        GenerationRequest([1, 2], cache_salt=bad)
