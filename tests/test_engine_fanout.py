"""`n > 1` in the engine: one prompt prefilled once, forked into n sequences (fanout.py),
and embedding requests (pooling.py) in the same step loop.

The tiny fp32 Qwen3 of conftest's `engine_model`, block size 16, stepped by hand. The page
and reference-count invariants are checked after every step.
"""

from __future__ import annotations

import pytest
from engine_helpers import prompt, tiny_engine

from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.fanout import child_params
from ninfer_core.engine.request import (
    FinishEvent,
    GenerationRequest,
    InvalidRequestError,
    RequestTooLargeError,
    TokenEvent,
)
from ninfer_core.sampling import SamplingParams
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.types import Proposal

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def by_index(result, n: int) -> tuple[list[list[int]], list[FinishEvent]]:
    """Each completion's token ids and its finish event, by `index`."""
    ids: list[list[int]] = [[] for _ in range(n)]
    finishes: list[FinishEvent | None] = [None] * n
    for event in result.events:
        if isinstance(event, TokenEvent):
            ids[event.index].extend(event.token_ids)
        else:
            assert finishes[event.index] is None, "two finishes for one index"
            finishes[event.index] = event
    assert all(f is not None for f in finishes)
    return ids, finishes  # type: ignore[return-value]


def run(engine, request: GenerationRequest):
    result = engine.add(request)
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    return result


@pytest.mark.parametrize("length", [37, 48], ids=["partial-block", "block-aligned"])
def test_n_completions_prefill_the_prompt_once_and_reproduce_with_a_seed(engine_model, length):
    ids = prompt(length, 1)
    params = SamplingParams(temperature=0.8, seed=1234)
    outs = []
    for _ in range(2):
        engine = tiny_engine(engine_model, max_concurrency=4, prefix_cache=False)
        req = GenerationRequest(ids, params, max_tokens=10, ignore_eos=True, n=4)
        result = run(engine, req)
        assert engine.counters.prefill_tokens == length  # the prompt ran once
        got, finishes = by_index(result, 4)
        assert all(len(t) == 10 for t in got)
        assert all(f.reason == "length" and f.usage.completion_tokens == 10 for f in finishes)
        assert all(f.request_id == req.request_id for f in finishes)
        outs.append(got)
    assert outs[0] == outs[1]
    assert len({tuple(t) for t in outs[0]}) > 1
    # Completion i is what n=1 with seed + i gives: the forks' K/V are the prompt's.
    for i in (0, 3):
        engine = tiny_engine(engine_model, max_concurrency=1, prefix_cache=False)
        alone = GenerationRequest(ids, child_params(params, i), max_tokens=10, ignore_eos=True)
        assert run(engine, alone).token_ids == outs[0][i]


def test_greedy_forks_agree_and_share_the_prompt_pages(engine_model):
    engine = tiny_engine(engine_model, max_concurrency=3)
    ids = prompt(40, 2)
    req = GenerationRequest(ids, SamplingParams(temperature=0), max_tokens=6, n=3, ignore_eos=True)
    result = engine.add(req)
    engine.step()  # the whole prompt, then the fork
    running = engine.scheduler.running
    assert len(running) == 3
    shared = running[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in running)
    assert len({s.block_table[2] for s in running}) == 3  # the partial page, copied
    engine.check_invariants()
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    got, _ = by_index(result, 3)
    assert got[0] == got[1] == got[2]


def test_cancel_ends_every_fork_and_frees_their_pages(engine_model):
    engine = tiny_engine(engine_model, max_concurrency=4)
    req = GenerationRequest(prompt(30, 3), max_tokens=50, n=4, ignore_eos=True)
    result = engine.add(req)
    engine.step()
    engine.step()
    assert engine.cancel(req.request_id)
    engine.step()
    engine.check_invariants()
    assert not engine.has_work and engine.block_manager.num_used_blocks == 0
    _, finishes = by_index(result, 4)
    assert {f.reason for f in finishes} == {"cancelled"}


def test_cancel_before_the_fork_still_ends_all_n(engine_model):
    engine = tiny_engine(engine_model, max_concurrency=2, prefill_chunk=16)
    req = GenerationRequest(prompt(60, 4), max_tokens=5, n=2)
    result = engine.add(req)
    engine.step()  # part of the prompt
    engine.cancel(req.request_id)
    engine.step()
    _, finishes = by_index(result, 2)
    assert [f.usage.completion_tokens for f in finishes] == [0, 0]
    engine.check_invariants()


def test_admission_reserves_slots_and_pages_for_all_n(engine_model):
    engine = tiny_engine(engine_model, max_concurrency=4, prefix_cache=False)
    first = engine.add(GenerationRequest(prompt(20, 5), max_tokens=8, n=3, ignore_eos=True))
    second = engine.add(GenerationRequest(prompt(20, 6), max_tokens=8, n=2, ignore_eos=True))
    engine.step()
    assert engine.scheduler.slots_in_use == 3  # the second waits for two free slots
    assert len(engine.scheduler.waiting) == 1
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert by_index(first, 3) and by_index(second, 2)


def test_n_over_the_limits_is_refused(engine_model):
    engine = tiny_engine(engine_model, max_concurrency=2)
    with pytest.raises(InvalidRequestError):
        engine.add(GenerationRequest([5, 6, 7], max_tokens=4, n=3))
    with pytest.raises(ValueError):
        GenerationRequest([5, 6, 7], n=0)
    small = tiny_engine(engine_model, max_concurrency=2, kv_capacity=64)
    with pytest.raises(RequestTooLargeError):  # 2 x 40 tokens of its own do not fit 64
        small.add(GenerationRequest(prompt(10, 7), max_tokens=40, n=2))


class AlwaysDraft:
    """Proposes the same tokens every round: every decode step verifies drafts."""

    uses_hidden = False

    def propose(self, inputs):
        return [Proposal([5, 6, 7][: item.max_drafts]) for item in inputs]

    def release(self, seq_id: int) -> None:
        pass


def speculating(engine_model) -> Engine:
    loaded, host, device = engine_model
    config = EngineConfig(kv_capacity=1024, max_concurrency=3, prefill_chunk=16)
    engine = Engine(loaded, config, host=host, device=device, kv_dtype="fp32",
                    spec=SpecConfig(spec="ngram", draft_tokens=3))  # fmt: skip
    engine.drafter = AlwaysDraft()
    return engine


def test_n_on_a_speculating_engine_is_refused(engine_model):
    with pytest.raises(InvalidRequestError, match="speculatively"):
        speculating(engine_model).add(GenerationRequest([5, 6, 7], max_tokens=4, n=2))


def test_an_embedding_beside_drafting_streams_pools_its_own_rows(engine_model):
    """An embedding prefilled in chunks while other sequences verify drafts in the same
    steps gets the vector it gets alone (its rows found by the batch's offsets)."""
    ids = prompt(45, 8)
    alone = tiny_engine(engine_model, max_concurrency=1, prefix_cache=False)
    (reference,) = alone.generate([GenerationRequest(ids, pooling="mean")])
    engine = speculating(engine_model)
    streams = [GenerationRequest(prompt(20, s), max_tokens=30, ignore_eos=True) for s in (9, 10)]
    results = [engine.add(r) for r in streams]
    for _ in range(6):
        engine.step()
    embedded = engine.add(GenerationRequest(ids, pooling="mean"))
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert engine.spec_counters.drafted > 0
    assert all(r.finish.reason == "length" for r in results)
    got, want = embedded.finish.embedding, reference.finish.embedding
    assert embedded.finish.reason == "stop" and embedded.finish.usage.completion_tokens == 0
    assert (got - want).abs().max().item() < 1e-5
    assert got.norm().item() == pytest.approx(1.0, abs=1e-5)


def test_a_fork_that_fails_ends_its_request_alone(engine_model, monkeypatch):
    engine = tiny_engine(engine_model, max_concurrency=4)
    other = engine.add(GenerationRequest(prompt(20, 13), max_tokens=6, ignore_eos=True))
    engine.step()

    def broken(blocks):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(engine.runtime.kv_store, "save_pages", broken)
    forked = engine.add(GenerationRequest(prompt(37, 14), max_tokens=6, n=3))
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    assert forked.finish.reason == "error" and "copy failed" in str(forked.finish.error)
    assert other.finish.reason == "length" and len(other.token_ids) == 6
