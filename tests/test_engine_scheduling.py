"""The engine's step loop: continuous batching, chunked prefill, the bounded queue, cancel.

A tiny fp32 Qwen3 (hidden 64, 2 layers) with a trained tokenizer; engines are stepped by hand
(`Engine.step`) with a fake clock, except in the asyncio test, which runs the step thread.
Block size 16 throughout.
"""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import prompt, tiny_engine

from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import (
    FinishEvent,
    GenerationRequest,
    OverloadedError,
    QueueTimeoutError,
    RequestTooLargeError,
    TokenEvent,
)
from ninfer_core.engine.scheduler import MIN_PENDING_TIMEOUT_S, PENDING_TIMEOUT_FACTOR, StepCosts
from ninfer_core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_engine(engine_model):
    def make(clock=None, **config) -> Engine:
        return tiny_engine(engine_model, clock=clock or FakeClock(), **config)

    return make


def request(ids: list[int], max_tokens: int = 12, **kw) -> GenerationRequest:
    return GenerationRequest(ids, GREEDY, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_alone(make_engine, ids: list[int], max_tokens: int = 12) -> list[int]:
    engine = make_engine(prefill_chunk=1024, max_concurrency=1, prefix_cache=False)
    return engine.generate([request(ids, max_tokens)])[0].token_ids


# --------------------------------------------------------------------------
# Continuous batching and chunked prefill
# --------------------------------------------------------------------------

LENGTHS = [9, 40, 23, 57]


@pytest.mark.parametrize(
    ("n", "chunk"), [(1, 7), (2, 16), (3, 5), (4, 24), (4, 1024)], ids=lambda v: str(v)
)
def test_concurrent_greedy_outputs_equal_each_run_alone(make_engine, n, chunk):
    """Chunks of 5, 7 and 24 end inside a 16-token block; 1024 takes whole prompts."""
    prompts = [prompt(LENGTHS[i], seed=10 + i) for i in range(n)]
    alone = [run_alone(make_engine, ids) for ids in prompts]
    engine = make_engine(max_concurrency=4, prefill_chunk=chunk)
    together = engine.generate([request(ids) for ids in prompts])
    assert [r.token_ids for r in together] == alone
    assert all(r.finish.reason == "length" for r in together)
    assert len({t for out in alone for t in out}) > 4  # a stuck model would prove little
    engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0


def test_requests_joining_mid_stream_keep_outputs(make_engine):
    """Requests arriving while others decode join the running batch, not a new one."""
    prompts = [prompt(n, seed=20 + n) for n in (30, 12, 45)]
    alone = [run_alone(make_engine, ids, 16) for ids in prompts]
    engine = make_engine(max_concurrency=3, prefill_chunk=8)
    results = [engine.add(request(prompts[0], 16))]
    for ids in prompts[1:]:
        for _ in range(5):
            engine.step()
        results.append(engine.add(request(ids, 16)))
    while engine.has_work:
        engine.step()
    assert [r.token_ids for r in results] == alone


def test_decode_keeps_running_while_another_prompt_prefills(make_engine):
    """The budget's split; pacing on the clock is off (`test_engine_pacing.py` has it)."""
    engine = make_engine(max_concurrency=2, prefill_chunk=32, decode_share=0.0)
    stream = engine.add(request(prompt(8, seed=1), max_tokens=40))
    engine.step()  # its whole prompt, first token
    long = engine.add(request(prompt(300, seed=2), max_tokens=4))
    both = mid_prefill_steps = 0
    while engine.has_work:
        out = engine.step()
        if long.request_id in out.still_prefilling:
            mid_prefill_steps += 1
            both += stream.request_id in out.decode
            assert out.prefill[long.request_id] == 31  # the rest of the 32-token budget
    # 300 prompt tokens at 31 a step: 9 steps end mid-prefill, and the stream decoded in each
    assert mid_prefill_steps == 9 and both == 9
    assert len(stream.token_ids) == 40 and len(long.token_ids) == 4


def test_text_deltas_and_stop_strings(make_engine):
    engine = make_engine()
    ids = prompt(20, seed=3)
    full = engine.generate([request(ids, 24)])[0]
    assert full.text == engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    assert all(isinstance(e, TokenEvent) for e in full.events[:-1])
    stop = full.text[6:9]
    assert len(stop) == 3
    cut = engine.generate([request(ids, 24, stop=[stop])])[0]
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.finish.reason == "stop" and cut.finish.matched == stop


# --------------------------------------------------------------------------
# Admission, the queue, cancel
# --------------------------------------------------------------------------


def test_requests_that_can_never_fit_are_refused_at_once(make_engine):
    engine = make_engine(max_context=256, kv_capacity=128)
    with pytest.raises(RequestTooLargeError, match="the context holds 256") as err:
        engine.add(request(prompt(200, seed=4), max_tokens=100))
    assert err.value.code == "request_too_large"
    with pytest.raises(RequestTooLargeError, match="the KV pool holds 128"):
        engine.add(request(prompt(100, seed=4), max_tokens=40))
    with pytest.raises(RequestTooLargeError):  # no max_tokens: the context is all used up
        engine.add(GenerationRequest(prompt(256, seed=4)))
    assert not engine.has_work


def test_third_submission_is_overloaded_at_once(make_engine):
    engine = make_engine(max_concurrency=1, max_pending_requests=1)
    engine.add(request(prompt(10, seed=5), 20))
    engine.add(request(prompt(10, seed=6), 20))
    with pytest.raises(OverloadedError) as err:
        engine.add(request(prompt(10, seed=7), 20))
    assert err.value.code == "overloaded" and err.value.retry_after >= 1
    engine.step()
    with pytest.raises(OverloadedError):  # one running, one queued: still full
        engine.add(request(prompt(10, seed=7), 20))


def test_queued_request_past_its_deadline_times_out(make_engine):
    clock = FakeClock()
    engine = make_engine(clock=clock, max_concurrency=1, pending_timeout_ms=5000)
    first = engine.add(request(prompt(10, seed=8), 30))
    late = engine.add(request(prompt(10, seed=9), 5))
    engine.step()
    clock.now = 4.9
    engine.step()
    assert late.finish is None
    clock.now = 5.0
    engine.step()
    assert late.finish.reason == "error" and late.token_ids == []
    assert isinstance(late.finish.error, QueueTimeoutError)
    assert late.finish.error.code == "queue_timeout" and late.finish.error.waited_s == 5.0
    while engine.has_work:
        engine.step()
    assert first.finish.reason == "length" and len(first.token_ids) == 30


def test_default_pending_timeout_is_derived_from_the_work_ahead(make_engine):
    clock = FakeClock()
    engine = make_engine(clock=clock, max_concurrency=1, max_context=1024)
    engine.add(request(prompt(100, seed=10), max_tokens=500))
    queued = engine.add(request(prompt(10, seed=11), max_tokens=5))
    # Before any step the costs are the slow priors: the first request's prefill + decode.
    ahead = 100 * StepCosts.PRIOR_PREFILL_TOKEN_S + 500 * StepCosts.PRIOR_DECODE_STEP_S
    limit = max(MIN_PENDING_TIMEOUT_S, PENDING_TIMEOUT_FACTOR * ahead)
    assert limit > MIN_PENDING_TIMEOUT_S
    seq = engine._live[queued.request_id].seq
    assert seq.deadline == pytest.approx(limit)
    engine.step()
    clock.now = limit - 1
    engine.step()
    assert queued.finish is None
    clock.now = limit
    engine.step()
    assert isinstance(queued.finish.error, QueueTimeoutError)


def test_step_costs_follow_measurements():
    costs = StepCosts()
    costs.observe(prefill_tokens=1000, decode_tokens=1, seconds=2.0)
    costs.observe(prefill_tokens=0, decode_tokens=2, seconds=0.05)
    assert costs.prefill_token_s == pytest.approx(0.002)
    assert costs.decode_step_s == pytest.approx(0.05)
    costs.observe(prefill_tokens=0, decode_tokens=2, seconds=0.15)
    assert costs.decode_step_s == pytest.approx(0.05 + StepCosts.SMOOTHING * 0.1)


def test_cancel_returns_pages_and_the_engine_keeps_serving(make_engine):
    engine = make_engine(max_concurrency=1, prefill_chunk=16, prefix_cache=False)
    baseline = engine.block_manager.num_used_blocks
    running = engine.add(request(prompt(60, seed=12), 50))
    queued = engine.add(request(prompt(20, seed=13), 50))
    for _ in range(6):
        engine.step()
    assert engine.block_manager.num_used_blocks > baseline
    assert engine.cancel(queued.request_id)  # still queued: ends at once
    assert queued.finish.reason == "cancelled" and queued.finish.usage.completion_tokens == 0
    assert engine.cancel(running.request_id)
    engine.step()
    assert running.finish.reason == "cancelled"
    assert 0 < running.finish.usage.completion_tokens < 50
    assert engine.block_manager.num_used_blocks == baseline and not engine.has_work
    assert not engine.cancel(running.request_id)
    engine.check_invariants()
    ids = prompt(33, seed=14)
    assert engine.generate([request(ids)])[0].token_ids == run_alone(make_engine, ids)


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(make_engine, monkeypatch, caplog):
    engine = make_engine()
    doomed = engine.add(request(prompt(10, seed=15)))
    run = engine.runner.step

    def broken(batch):
        monkeypatch.setattr(engine.runner, "step", run)
        raise RuntimeError("device fell over")

    monkeypatch.setattr(engine.runner, "step", broken)
    engine.step()
    assert doomed.finish.reason == "error" and doomed.finish.error.code == "internal_error"
    assert "device fell over" in str(doomed.finish.error) and "engine step failed" in caplog.text
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_work
    ids = prompt(12, seed=16)
    assert engine.generate([request(ids)])[0].token_ids == run_alone(make_engine, ids)


# --------------------------------------------------------------------------
# The async API, with the step thread running
# --------------------------------------------------------------------------


def test_async_submit_stream_cancel_and_errors(make_engine):
    prompts = [prompt(n, seed=30 + n) for n in (14, 37, 22)]
    want = [run_alone(make_engine, ids, 10) for ids in prompts]
    engine = make_engine(max_concurrency=2, max_pending_requests=2, prefill_chunk=8)

    async def collect(stream) -> tuple[list[int], FinishEvent]:
        tokens = []
        async for event in stream:
            if isinstance(event, TokenEvent):
                tokens.extend(event.token_ids)
            else:
                return tokens, event
        raise AssertionError("the stream ended without a finish")

    async def main() -> None:
        streams = [engine.submit(request(ids, 10)) for ids in prompts]
        endless = engine.submit(request(prompt(10, seed=40), 400))
        with pytest.raises(OverloadedError):
            engine.submit(request(prompt(10, seed=41), 10))
        results = await asyncio.wait_for(asyncio.gather(*map(collect, streams)), 60)
        assert [tokens for tokens, _ in results] == want
        assert all(f.reason == "length" and f.usage.completion_tokens == 10 for _, f in results)
        first = await asyncio.wait_for(anext(endless), 60)  # a client that reads, then leaves
        assert isinstance(first, TokenEvent)
        await endless.aclose()
        doomed = engine.submit(request(prompt(10, seed=42), 5, pending_timeout_s=0.0))
        with pytest.raises(QueueTimeoutError):
            await asyncio.wait_for(collect(doomed), 60)

    try:
        asyncio.run(main())
        for _ in range(200):  # the cancel lands at the thread's next step
            if not engine.has_work:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert not engine.has_work
        engine.check_invariants()
    finally:
        engine.close()


def test_token_ids_outside_the_vocabulary_are_refused(make_engine):
    from ninfer_core.engine.request import InvalidRequestError

    engine = make_engine()
    vocab = engine.vocab_size
    for bad in (-1, vocab):
        with pytest.raises(InvalidRequestError, match=str(bad)):
            engine.add(GenerationRequest([1, 2, bad], max_tokens=2))


def test_an_unset_pool_holds_the_context_the_model_serves_not_the_one_asked(engine_model):
    """The tiny model has 1024 positions: --max-context 184320 with no --kv-capacity must
    size a 1024-token pool, not a 184K one."""
    eng = tiny_engine(engine_model, max_context=184320, kv_capacity=0)
    assert eng.max_context == 1024
    assert eng.block_manager.num_blocks * eng.block_manager.block_size == 1024
