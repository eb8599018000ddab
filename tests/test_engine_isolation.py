"""One bad sequence ends its own request; the others in its batch keep their exact tokens.

Three greedy requests share every step; the middle one is poisoned in a different way in each
test (its forward raises, its token id is corrupt, its logits are NaN, the sampler or its
detokenizer fails on it). The reference for the two victims is each one run alone on a fresh
engine: a victim that lost a token, got another's K/V or ended early shows up as a difference.
Before this, every one of these faults ended all three requests with `the step failed`.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from engine_helpers import prompt, tiny_engine

from ninfer_core.engine.engine import Engine
from ninfer_core.engine.faults import unusable_rows
from ninfer_core.engine.model_runner import StepForward
from ninfer_core.engine.request import GenerationRequest, RequestResult
from ninfer_core.engine.sequence import Sequence
from ninfer_core.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 10


class FakeClock:
    def __call__(self) -> float:
        return 0.0


@pytest.fixture
def make_engine(engine_model):
    def make(**config) -> Engine:
        return tiny_engine(engine_model, clock=FakeClock(), **config)

    return make


PROMPTS = [prompt(11, 1), prompt(19, 2), prompt(7, 3)]
POISONED = 1


def request(ids: list[int], params: SamplingParams = GREEDY) -> GenerationRequest:
    return GenerationRequest(ids, params, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(engine_model) -> list[list[int]]:
    """Each prompt's tokens, run on an engine of its own (the independent reference)."""
    out = []
    for ids in PROMPTS:
        engine = tiny_engine(engine_model, clock=FakeClock(), prefix_cache=False)
        out.append(engine.generate([request(ids)])[0].token_ids)
    return out


def start(
    engine: Engine, poisoned: SamplingParams = GREEDY
) -> tuple[list[RequestResult], Sequence]:
    """The three requests added together; returns their sinks and the poisoned sequence."""
    sinks = [
        engine.add(request(ids, poisoned if i == POISONED else GREEDY))
        for i, ids in enumerate(PROMPTS)
    ]
    return sinks, engine._live[sinks[POISONED].request_id].seq


def finish(engine: Engine) -> None:
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0


def assert_victims_unharmed(sinks: list[RequestResult], alone: list[list[int]]) -> None:
    for i, sink in enumerate(sinks):
        if i != POISONED:
            assert sink.finish.reason == "length", sink.finish
            assert sink.token_ids == alone[i]


def assert_failed(sink: RequestResult, *words: str) -> None:
    assert sink.finish.reason == "error" and sink.finish.error.code == "internal_error"
    assert all(word in str(sink.finish.error) for word in words), str(sink.finish.error)


def test_a_forward_that_fails_on_one_sequence_ends_only_that_request(make_engine, alone):
    engine = make_engine(max_concurrency=3)
    sinks, bad = start(engine)
    real = engine.runner.step
    calls = []

    def run(batch):
        calls.append(len(batch))
        if any(seq is bad for seq, _ in batch) and len(calls) > 2:  # fails from its 3rd step
            raise IndexError("index out of range in self")
        return real(batch)

    engine.runner.step = run
    finish(engine)
    assert_failed(sinks[POISONED], "IndexError", "index out of range")
    assert 0 < len(sinks[POISONED].token_ids) < MAX_TOKENS
    assert_victims_unharmed(sinks, alone)
    assert calls[2:6] == [3, 1, 1, 1]  # the batch, then each sequence alone


def test_a_corrupt_token_id_in_the_real_forward_ends_only_its_request(make_engine, alone):
    """The issue's path: an id past the vocabulary reaches the embedding, which raises."""
    engine = make_engine(max_concurrency=3)
    sinks, bad = start(engine)
    while len(bad.completion_ids) < 2:
        engine.step()
    bad.token_ids[-1] = engine.vocab_size  # the pending token, not yet run
    finish(engine)
    assert_failed(sinks[POISONED])
    assert_victims_unharmed(sinks, alone)


def test_a_transient_batch_failure_is_retried_and_nobody_fails(make_engine, alone):
    engine = make_engine(max_concurrency=3)
    sinks, _ = start(engine)
    real = engine.runner.step
    failures = []

    def run(batch):
        if len(batch) == 3 and not failures:  # the device hiccups once on the full batch
            failures.append(batch)
            raise RuntimeError("out of memory")
        return real(batch)

    engine.runner.step = run
    finish(engine)
    assert failures
    assert_victims_unharmed(sinks, alone)
    assert sinks[POISONED].finish.reason == "length"
    assert sinks[POISONED].token_ids == alone[POISONED]


def test_nan_logits_end_only_their_request(make_engine, alone):
    """A sampled request whose row is NaN drew id V (one past the vocabulary) before."""
    engine = make_engine(max_concurrency=3)
    sinks, bad = start(engine, SamplingParams(temperature=1.0, seed=0))
    real = engine.runner.step

    def run(batch):
        out = real(batch)
        logits = out.logits.clone()
        for i, (seq, _) in enumerate(batch):
            if seq is bad and len(seq.completion_ids) >= 3:
                logits[i] = float("nan")
        return StepForward(logits, out.hidden)

    engine.runner.step = run
    finish(engine)
    assert_failed(sinks[POISONED], "no finite value")
    assert len(sinks[POISONED].token_ids) == 3
    assert_victims_unharmed(sinks, alone)


def test_a_sampled_id_outside_the_vocabulary_ends_only_its_request(make_engine, alone):
    engine = make_engine(max_concurrency=3)
    sinks, _ = start(engine)
    history = engine._live[sinks[POISONED].request_id].history
    real = engine.postprocess.sampler.sample

    def sample(logits, params, histories):
        tokens = real(logits, params, histories)
        for i, h in enumerate(histories):
            if h is history:
                tokens[i] = engine.vocab_size
        return tokens

    engine.postprocess.sampler.sample = sample
    finish(engine)
    assert_failed(sinks[POISONED], f"sampled token id {engine.vocab_size}")
    assert sinks[POISONED].token_ids == []
    assert_victims_unharmed(sinks, alone)


def test_a_sampler_that_raises_on_one_row_ends_only_its_request(make_engine, alone):
    engine = make_engine(max_concurrency=3)
    sinks, _ = start(engine)
    history = engine._live[sinks[POISONED].request_id].history
    real = engine.postprocess.sampler.sample

    def sample(logits, params, histories):
        if any(h is history for h in histories):
            raise RuntimeError("bad row")
        return real(logits, params, histories)

    engine.postprocess.sampler.sample = sample
    finish(engine)
    assert_failed(sinks[POISONED], "sampling failed", "bad row")
    assert_victims_unharmed(sinks, alone)


def test_a_text_step_that_raises_ends_only_its_request(make_engine, alone):
    engine = make_engine(max_concurrency=3)
    sinks, _ = start(engine)
    detok = engine._live[sinks[POISONED].request_id].detok

    def feed(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    detok.feed = feed
    finish(engine)
    assert_failed(sinks[POISONED], "UnicodeDecodeError")
    assert_victims_unharmed(sinks, alone)


def test_unusable_rows_are_exactly_those_without_a_finite_value():
    rng = random.Random(3)
    values = [float("nan"), float("inf"), float("-inf"), 0.0, -1e30, 3.4e38]
    rows = [[rng.choice(values) for _ in range(rng.randrange(1, 6))] for _ in range(200)]
    for row in rows:
        want = not any(math.isfinite(v) for v in row)
        assert unusable_rows(torch.tensor([row, [0.0] * len(row)])) == [want, False], row
