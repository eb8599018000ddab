"""`logprobs` and `min_tokens` in the engine: the figures, the mask, and the same answer
with and without speculative decoding (`engine/token_extras.py`)."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import prompt

from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.sampling import LOGPROB_FLOOR, SamplingParams, token_logprobs
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.types import Proposal

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0)
PENALISED = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5)
NGRAM = SpecConfig(spec="ngram", draft_tokens=3)


def engine(engine_model, spec: SpecConfig | None = None) -> Engine:
    loaded, host, device = engine_model
    config = EngineConfig(kv_capacity=1024, max_concurrency=2)
    return Engine(loaded, config, host=host, device=device, kv_dtype="fp32", spec=spec, seed=0)


def run(engine_model, ids, spec=None, drafter=None, **kw):
    e = engine(engine_model, spec)
    if drafter is not None:
        e.drafter = drafter
    (result,) = e.generate([GenerationRequest(ids, **kw)])
    return result


class Replay:
    """Drafts what a reference run wrote next, every third draft wrong: rounds accept some
    drafts and reject others, whatever the model would repeat on its own."""

    uses_hidden = False

    def __init__(self, reference: list[int], vocab: int = 400) -> None:
        self.reference, self.vocab, self.calls = reference, vocab, 0

    def propose(self, inputs):
        out = []
        for item in inputs:
            tokens = list(item.token_ids)
            drafts = []
            if self.reference[: len(tokens)] == tokens:
                drafts = self.reference[len(tokens) : len(tokens) + item.max_drafts]
            for i in range(len(drafts)):
                self.calls += 1
                if self.calls % 3 == 0:
                    drafts[i] = (drafts[i] + 1) % self.vocab
            out.append(Proposal(drafts))
        return out

    def release(self, seq_id: int) -> None:
        pass


def logprobs_of(result):
    return [lp for event in result.events[:-1] for lp in event.logprobs or ()]


def test_token_logprobs_are_a_log_softmax_with_sorted_alternatives():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("-inf")
    got = token_logprobs(logits, [4, 7, 0], [5, 0, 50])
    expected = logits.log_softmax(dim=-1)
    assert got[0].logprob == pytest.approx(expected[0, 4].item(), abs=1e-6)
    assert got[1].logprob == LOGPROB_FLOOR and got[1].top == ()  # JSON has no -inf
    values = [lp for _, lp in got[2].top]
    assert len(values) == 50 and values == sorted(values, reverse=True)
    assert [t for t, _ in got[0].top] == expected[0].topk(5).indices.tolist()
    assert all(math.isfinite(lp) for item in got for _, lp in item.top)


def test_a_request_without_logprobs_gets_none(engine_model):
    result = run(engine_model, prompt(12, 1), params=GREEDY, max_tokens=4, ignore_eos=True)
    assert all(event.logprobs is None for event in result.events[:-1])


@pytest.mark.parametrize("params", [GREEDY, PENALISED], ids=["greedy", "penalised"])
def test_speculation_reports_the_same_logprobs(engine_model, params):
    ids = prompt(6, 3) * 4  # repeats: n-gram drafts get proposed and accepted
    kw = dict(params=params, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = run(engine_model, ids, **kw)
    drafter = Replay([*ids, *plain.token_ids])
    spec = run(engine_model, ids, NGRAM, drafter, **kw)
    usage = spec.finish.usage.spec
    assert 0 < usage.accepted < usage.drafted
    assert spec.token_ids == plain.token_ids
    for a, b, token in zip(logprobs_of(spec), logprobs_of(plain), plain.token_ids, strict=True):
        assert a.token_id == b.token_id == token
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.top[0][0] == token  # greedy over the penalised logits: its own top entry


class StopDrafts:
    """`Replay`'s drafts with the stop token put first while the answer is short."""

    uses_hidden = False

    def __init__(self, replay: Replay, stop: int) -> None:
        self.replay, self.stop, self.stops = replay, stop, 0

    def propose(self, inputs):
        out = self.replay.propose(inputs)
        for item, proposal in zip(inputs, out, strict=True):
            if proposal.token_ids and len(item.token_ids) % 2:
                proposal.token_ids[0] = self.stop
                self.stops += 1
        return out

    def release(self, seq_id: int) -> None:
        pass


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_min_tokens_masks_stop_tokens_until_reached(engine_model, spec):
    ids = prompt(6, 5) * 4
    free = run(engine_model, ids, params=GREEDY, max_tokens=16, ignore_eos=True).token_ids
    # A token the model first writes once a round decides it (drafts start after token 1).
    first, stop = next((i, t) for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    kw = dict(params=GREEDY, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    early = run(engine_model, ids, spec, **kw)
    assert early.token_ids == free[: first + 1] and early.finish.reason == "stop"
    want = run(engine_model, ids, None, min_tokens=8, **kw).token_ids
    assert len(want) >= 8 and stop not in want[:8]
    # Drafts of the answer, and of the stop token where the mask must refuse it.
    drafter = None if spec is None else StopDrafts(Replay([*ids, *want]), stop)
    held = run(engine_model, ids, spec, drafter, min_tokens=8, **kw)
    assert held.token_ids == want
    if spec is not None:
        assert held.finish.usage.spec.accepted > 0 and drafter.stops > 0


def test_min_tokens_and_logprobs_are_checked():
    with pytest.raises(ValueError, match="min_tokens"):
        GenerationRequest([1], min_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        GenerationRequest([1], max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="logprobs"):
        GenerationRequest([1], logprobs=21)
