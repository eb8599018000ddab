"""The prefix cache of a hybrid model: state snapshots (`engine/state_snapshots.py`).

On the tiny random Qwen3-Next of test_hybrid_family.py (3 Gated DeltaNet layers, 1
attention layer, block size 16), fp32. Every warm run is checked against a cold run of the
same prompt in a fresh engine, token for token and logits row for logits row, and against
transformers where that is cheap; and the tokens the runner ran are counted, so a hit that
quietly recomputed everything would fail too. One test breaks the restore on purpose and
checks that the output changes: these comparisons can fail.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import prompt
from hybrid_helpers import TOL, greedy_request, load_fp32, reference_greedy, reference_logits
from test_hybrid_family import write_tiny_qwen3_next

from ninfer_core.cli.main import main
from ninfer_core.device import GIB
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.memory import DeviceMemory, estimate_workspace, kv_layers, plan_memory
from ninfer_core.memory.planner import bytes_per_snapshot
from ninfer_core.memory.table import render_table
from ninfer_core.model.caches import caches_for
from ninfer_core.sampling import SamplingParams
from ninfer_core.spec.types import DraftOptions, Proposal

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BLOCK = 16


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """(folder, transformers' model) of the tiny Qwen3-Next."""
    path = tmp_path_factory.mktemp("qwen3-next-prefix")
    return path, write_tiny_qwen3_next(path)


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    """(reference, loaded, host, device): transformers' model and ours, both fp32."""
    path, reference = hybrid_dir
    return (reference, *load_fp32(path))


class Recorder:
    """Wraps the engine's runner: the tokens each step ran, and each logits row by the
    position it predicts (`num_computed_tokens` after the step). One request at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.ran, self.rows = engine, 0, {}
        inner = engine.runner.step

        def step(batch):
            out = inner(batch)
            for i, (seq, n) in enumerate(batch):
                self.ran += n
                self.rows[seq.num_computed_tokens] = out.logits[i].clone()
            return out

        engine.runner.step = step

    def run(self, request: GenerationRequest):
        """(result, tokens run, {position: logits row}) of `request` alone."""
        self.ran, self.rows = 0, {}
        (result,) = self.engine.generate([request])
        self.engine.check_invariants()
        return result, self.ran, self.rows


def make_engine(hybrid, kv_dtype: str = "fp32", **config) -> Recorder:
    _, loaded, host, device = hybrid
    cfg = EngineConfig(**{"kv_capacity": 1024, "max_concurrency": 2, **config})
    return Recorder(Engine(loaded, cfg, host=host, device=device, kv_dtype=kv_dtype))


def cold(hybrid, ids: list[int], n: int, kv_dtype: str = "fp32"):
    """The same request in a fresh engine (nothing cached)."""
    return make_engine(hybrid, kv_dtype).run(greedy_request("cold", ids, n))


def assert_same_rows(warm: dict, reference: dict, start: int, exact: bool = False) -> None:
    """The sampled rows (positions from `start`, the prompt's length) agree: bit for bit
    when the same prompt resumes, else within the family's parity tolerance (`TOL`): a
    resumed prompt runs its new tokens in other chunks, so sums run in another order."""
    keys = sorted(k for k in reference if k >= start)
    assert keys and keys == sorted(k for k in warm if k >= start)
    for k in keys:
        if exact:
            assert torch.equal(warm[k], reference[k]), k
        else:
            assert (warm[k] - reference[k]).abs().max().item() <= TOL, k


def test_a_follow_up_sharing_a_long_prefix_prefills_only_the_new_tokens(hybrid):
    reference = hybrid[0]
    first = prompt(53, seed=11)  # 3 blocks + 5
    follow = [*first, *prompt(9, seed=12)]
    rec = make_engine(hybrid)
    rec.run(greedy_request("a", first, 4))
    result, ran, rows = rec.run(greedy_request("b", follow, 8))
    # Resumed at 52 (the first prompt's snapshot before its last token): the 9 new
    # tokens and that one run, then 7 decode steps.
    assert result.finish.usage.cached_tokens == 52
    assert ran == 10 + 7
    cold_result, cold_ran, cold_rows = cold(hybrid, follow, 8)
    assert cold_ran == 62 + 7
    assert result.token_ids == cold_result.token_ids == reference_greedy(reference, follow, 8)
    assert_same_rows(rows, cold_rows, len(follow))
    ref = reference_logits(reference, follow)[-1]
    assert (rows[len(follow)] - ref).abs().max().item() <= TOL


def test_a_prompt_shorter_than_a_block_hits_its_own_earlier_snapshot(hybrid):
    ids = prompt(11, seed=13)
    rec = make_engine(hybrid)
    first, _, first_rows = rec.run(greedy_request("a", ids, 6))
    again, ran, rows = rec.run(greedy_request("b", ids, 6))
    assert first.finish.usage.cached_tokens == 0
    assert again.finish.usage.cached_tokens == len(ids) - 1 and ran == 1 + 5
    assert again.token_ids == first.token_ids == cold(hybrid, ids, 6)[0].token_ids
    # The same state and the same page bytes, the same last step: bit for bit.
    assert_same_rows(rows, first_rows, len(ids), exact=True)


def test_a_multi_turn_follow_up_resumes_from_the_end_of_the_request(hybrid):
    ids = prompt(20, seed=14)
    rec = make_engine(hybrid)
    turn, _, _ = rec.run(greedy_request("a", ids, 6))
    follow = [*ids, *turn.token_ids, *prompt(5, seed=15)]
    result, ran, rows = rec.run(greedy_request("b", follow, 6))
    # The first request's state covered its prompt and 5 of its 6 tokens (the last
    # sampled one never ran): 25 tokens.
    assert result.finish.usage.cached_tokens == 25
    assert ran == (len(follow) - 25) + 5
    cold_result, _, cold_rows = cold(hybrid, follow, 6)
    assert result.token_ids == cold_result.token_ids
    assert_same_rows(rows, cold_rows, len(follow))


def test_a_shared_system_prompt_is_snapshot_where_the_cached_blocks_end(hybrid):
    system = prompt(53, seed=16)
    asks = [[*system, *prompt(6 + i, seed=17 + i)] for i in range(3)]
    rec = make_engine(hybrid)
    usage = []
    for i, ids in enumerate(asks):
        result, ran, _ = rec.run(greedy_request(f"q{i}", ids, 4))
        usage.append((result.finish.usage.cached_tokens, ran - 3))
        assert result.token_ids == cold(hybrid, ids, 4)[0].token_ids
    # The second finds 3 cached blocks but no state there: it recomputes everything (a
    # block hit alone would lack the state), and snapshots at 48 on its way; the third
    # resumes there.
    assert usage == [(0, 59), (0, 60), (48, 61 - 48)]


def test_snapshots_are_evicted_least_recently_used_first(hybrid):
    rec = make_engine(hybrid, state_snapshots=2)
    snaps = rec.engine.runtime.snapshots
    ids = [prompt(9, seed=30 + i) for i in range(3)]
    for i, p in enumerate(ids):
        rec.run(greedy_request(f"r{i}", p, 3))
    assert len(snaps) == 2 and snaps.evicted == 4  # two a request: prompt end, request end
    first, _, _ = rec.run(greedy_request("again0", ids[0], 3))
    assert first.finish.usage.cached_tokens == 0
    # Re-running the first evicted the third's; the first's own are the newest now.
    second, _, _ = rec.run(greedy_request("again0b", ids[0], 3))
    assert second.finish.usage.cached_tokens == len(ids[0]) - 1
    third, _, _ = rec.run(greedy_request("again2", ids[2], 3))
    assert third.finish.usage.cached_tokens == 0
    assert len(snaps) == 2 and snaps.nbytes > 0


def salted(rid: str, ids: list[int], salt: str | None) -> GenerationRequest:
    params = SamplingParams(temperature=0.0)
    return GenerationRequest(
        ids, params, max_tokens=3, ignore_eos=True, request_id=rid, cache_salt=salt
    )


def test_requests_with_different_salts_never_share_a_snapshot(hybrid):
    short, long = prompt(9, seed=40), prompt(40, seed=41)
    rec = make_engine(hybrid, state_snapshots=16)
    for ids in (short, long):
        rec.run(salted("a", ids, "alice"))
        for salt in ("bob", None):
            result, _, _ = rec.run(salted("b", ids, salt))
            assert result.finish.usage.cached_tokens == 0, (len(ids), salt)
        result, _, _ = rec.run(salted("c", ids, "alice"))
        assert result.finish.usage.cached_tokens == len(ids) - 1


@pytest.mark.parametrize("codec", ["int8", "rk8v4"])
def test_quantized_codecs_restore_their_tail_pages_bit_exactly(hybrid, codec):
    ids = prompt(37, seed=50)  # 2 blocks + 5: a partial page in every snapshot
    follow = [*ids, *prompt(4, seed=51)]
    rec = make_engine(hybrid, codec)
    first, _, first_rows = rec.run(greedy_request("a", ids, 6))
    again, ran, rows = rec.run(greedy_request("b", ids, 6))
    assert again.finish.usage.cached_tokens == 36 and ran == 1 + 5
    assert again.token_ids == first.token_ids == cold(hybrid, ids, 6, codec)[0].token_ids
    assert_same_rows(rows, first_rows, len(ids), exact=True)
    result, _, _ = rec.run(greedy_request("c", follow, 6))
    assert result.finish.usage.cached_tokens == 36
    assert result.token_ids == cold(hybrid, follow, 6, codec)[0].token_ids


@pytest.mark.parametrize("codec", ["fp32", "int8", "rk8v4"])
def test_save_and_load_pages_copy_the_stored_bytes(hybrid, codec):
    store = make_engine(hybrid, codec).engine.runtime.kv_store
    g = torch.Generator().manual_seed(0)
    hkv, d = store.layout.num_kv_heads, store.layout.head_dim
    slots = torch.arange(2 * BLOCK, 3 * BLOCK)  # page 2
    k, v = torch.randn(2, BLOCK, hkv, d, generator=g)
    store.write(0, slots, k, v)
    saved = store.save_pages(torch.tensor([2]))
    before = store.gather(0, torch.tensor([2]))
    store.load_pages(torch.tensor([5]), saved)  # into another page
    after = store.gather(0, torch.tensor([5]))
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    store.write(0, slots, -k, -v)  # the copy does not alias the pool
    assert torch.equal(store.save_pages(torch.tensor([5]))[0], saved[0])


def test_a_broken_restore_changes_the_output(hybrid):
    """Zeroing the snapshot's states (the tail page stays right) must show: the checks
    above compare against something that a wrong state gets wrong."""
    ids = prompt(27, seed=60)
    rec = make_engine(hybrid)
    _, _, first_rows = rec.run(greedy_request("a", ids, 6))
    for snap in rec.engine.runtime.snapshots._lru.values():
        for tensors in snap.states.values():
            for t in tensors:
                t.zero_()
    again, _, rows = rec.run(greedy_request("b", ids, 6))
    assert again.finish.usage.cached_tokens == len(ids) - 1
    assert (rows[len(ids)] - first_rows[len(ids)]).abs().max().item() > 1e-2


def test_no_snapshots_means_no_prefix_cache_for_a_hybrid_model(hybrid):
    ids = prompt(40, seed=70)
    rec = make_engine(hybrid, state_snapshots=0)
    assert rec.engine.runtime.snapshots is None and rec.engine.block_manager.cache is None
    rec.run(greedy_request("a", ids, 3))
    result, ran, _ = rec.run(greedy_request("b", ids, 3))
    assert result.finish.usage.cached_tokens == 0 and ran == 40 + 2


def test_concurrent_requests_with_snapshots_equal_each_run_alone(hybrid):
    system = prompt(30, seed=80)
    prompts = [[*system, *prompt(5 + i, seed=81 + i)] for i in range(4)]
    alone = [cold(hybrid, p, 5)[0].token_ids for p in prompts]
    rec = make_engine(hybrid, prefill_chunk=7, state_snapshot_interval=16, state_snapshots=16)
    eng = rec.engine
    results = eng.generate([greedy_request(f"r{i}", p, 5) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in results] == alone
    again = eng.generate([greedy_request(f"s{i}", p, 5) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in again] == alone
    assert [r.finish.usage.cached_tokens for r in again] == [len(p) - 1 for p in prompts]
    eng.check_invariants()
    assert eng.runtime.states.num_free == 2


# --------------------------------------------------------------------------
# The memory plan counts the snapshots
# --------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_the_plans_bytes_per_snapshot_are_what_a_snapshot_holds(hybrid, codec):
    _, loaded, host, _ = hybrid
    rec = make_engine(hybrid, codec)
    rec.run(greedy_request("a", prompt(21, seed=90), 2))  # snapshots at 20 and 22: tails
    snaps = list(rec.engine.runtime.snapshots._lru.values())
    assert snaps and all(s.pages is not None for s in snaps)
    layers = kv_layers(caches_for(loaded.family, loaded.config), host.kv_codecs.get(codec))
    assert {s.nbytes for s in snaps} == {bytes_per_snapshot(layers, BLOCK)}


def test_the_plan_takes_the_snapshots_off_the_top(hybrid):
    _, loaded, host, _ = hybrid
    codec = host.kv_codecs.get("fp32")
    config, caches = loaded.config, caches_for(loaded.family, loaded.config)
    ws = estimate_workspace(
        config, dtype=torch.float32, kv_codec=codec, prefill_chunk=256, context=256
    )
    memory = DeviceMemory("card", GIB, GIB, "test")
    kw = dict(weights_bytes=0, codec=codec, memory=memory, workspace=ws, max_context=256,
              max_concurrency=2, caches=caches, kv_capacity="auto")  # fmt: skip
    without, with_ = plan_memory(config, **kw), plan_memory(config, **kw, state_snapshots=6)
    each = without.state_bytes_per_sequence // 2 + BLOCK * without.kv_bytes_per_token
    assert with_.snapshot_bytes_each == each and with_.snapshot_bytes == 6 * each
    assert without.snapshot_bytes == 0 and "state snapshots" not in render_table(without)
    assert with_.used_bytes - with_.pool_bytes == without.used_bytes - without.pool_bytes + 6 * each
    assert with_.pool_pages <= without.pool_pages
    assert f"6 x {each} bytes" in render_table(with_)
    dense = plan_memory(config, **{**kw, "caches": None}, state_snapshots=6)
    assert dense.snapshot_bytes == 0 and dense.state_snapshots == 0


def test_ninfer_plan_prints_the_state_snapshots_line(hybrid_dir, capsys):
    path, _ = hybrid_dir
    args = ["plan", str(path), "--max-context", "256", "--max-concurrency", "3", "--dtype", "fp32"]
    assert main(args) == 0
    line = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("state snap"))
    assert "6 x " in line  # the default: 2 x --max-concurrency
    assert main([*args, "--state-snapshots", "5"]) == 0
    assert "5 x " in capsys.readouterr().out
    assert main([*args, "--no-prefix-cache"]) == 0
    assert "state snapshots" not in capsys.readouterr().out


def test_a_snapshot_whose_blocks_were_evicted_is_not_used(hybrid):
    """A 4-page pool: a long second prompt evicts the first prompt's idle blocks, so its
    snapshot (after 2 full blocks) has no K/V to go with it any more."""
    ids, other = prompt(37, seed=110), prompt(60, seed=111)
    rec = make_engine(hybrid, kv_capacity=64)
    rec.run(greedy_request("a", ids, 3))
    rec.run(greedy_request("b", other, 3))
    again, ran, _ = rec.run(greedy_request("c", ids, 3))
    assert again.finish.usage.cached_tokens == 0 and ran == 37 + 2
    assert again.token_ids == cold(hybrid, ids, 3)[0].token_ids


def test_a_store_without_page_copies_resumes_on_block_boundaries_only(hybrid):
    pytest.importorskip("ninfer_kv_toy")
    rec = make_engine(hybrid, "toy-int16")
    assert not rec.engine.runtime.snapshots.partial
    short, aligned = prompt(11, seed=120), prompt(33, seed=121)  # 33 - 1 = 2 blocks
    for ids, cached in ((short, 0), (aligned, 32)):
        first, _, _ = rec.run(greedy_request("a", ids, 4))
        again, _, _ = rec.run(greedy_request("b", ids, 4))
        assert again.finish.usage.cached_tokens == cached
        assert again.token_ids == first.token_ids


class RightDrafter:
    """Proposes a known continuation: every draft right, so a stop token can be accepted
    as a draft and end the request inside a round."""

    uses_hidden = False

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference

    def propose(self, inputs):
        out = []
        for item in inputs:
            tokens = list(item.token_ids)
            ok = self.reference[: len(tokens)] == tokens and item.max_drafts
            drafts = self.reference[len(tokens) : len(tokens) + item.max_drafts] if ok else []
            out.append(Proposal(drafts))
        return out

    def release(self, seq_id: int) -> None:
        pass


def test_a_request_that_stops_inside_a_round_snapshots_the_state_it_kept(hybrid):
    """The stop token is accepted as a draft: the request ends inside a round, its state
    put back to the round's start (`Sequence.state_position`, the prompt); the snapshot
    is taken there, not after the drafts, and a follow-up resumes from it exactly."""
    _, loaded, host, device = hybrid
    ids = prompt(20, seed=100)
    want = cold(hybrid, ids, 12)[0].token_ids
    stop = next(m for m in (2, 3, 4) if want[m] not in want[:m])
    config = EngineConfig(kv_capacity=1024, max_concurrency=2)
    eng = Engine(loaded, config, host=host, device=device, kv_dtype="fp32")
    eng.drafter, eng.spec_name = RightDrafter(ids + want), "right"
    eng.spec_options = DraftOptions(5)
    request = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=12,
                                ignore_eos=True, stop_token_ids=[want[stop]])  # fmt: skip
    (turn,) = eng.generate([request])
    assert turn.token_ids == want[: stop + 1] and eng.spec_counters.accepted > 0
    follow = [*ids, *turn.token_ids, *prompt(6, seed=101)]
    (result,) = eng.generate([greedy_request("b", follow, 8)])
    eng.check_invariants()
    assert result.finish.usage.cached_tokens == len(ids)
    assert result.token_ids == cold(hybrid, follow, 8)[0].token_ids
