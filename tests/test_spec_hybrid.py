"""Speculative decoding on models with per-sequence state: rolled back by replay, lossless.

The targets are tiny random Qwen3.5 text models, dense and MoE (3 Gated DeltaNet layers +
1 full-attention layer, `test_hybrid_qwen3_5.py`), fp32. A round that rejects a draft has
run the drafts through every state layer, so the engine puts the state back to the step's
start and the next step replays the accepted tokens (`engine/speculation.py`). A scripted
drafter proposes the reference continuation with every n-th token corrupted, so rounds
accept, reject and take the bonus; the real `ngram` strategy is checked the same way. The
reference is a run without speculation, and where cheap transformers' greedy `generate`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import prompt
from hybrid_helpers import engine, greedy_request, load_fp32, reference_greedy, save_perturbed
from spec_helpers import ScriptedDrafter, mixed_steps, speculate_with
from test_hybrid_qwen3_5 import COMMON, MOE

from ninfer_core.cli.main import main
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sequence import SequenceStatus
from ninfer_core.kv.state import SequenceStatePool
from ninfer_core.sampling import SamplingParams
from ninfer_core.spec.config import SpecConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 32


def write_qwen3_5(path, variant: str, init: float) -> torch.nn.Module:
    """A seeded random Qwen3.5 text model, `variant` "dense" or "moe", saved to `path` as
    `test_hybrid_qwen3_5.py` does, its weights drawn with `initializer_range` `init`."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    common = {**COMMON, "initializer_range": init}
    if variant == "dense":
        config, cls = Qwen3_5TextConfig(**common, intermediate_size=96), Qwen3_5ForCausalLM
    else:
        config, cls = Qwen3_5MoeTextConfig(**common, **MOE), Qwen3_5MoeForCausalLM
        config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    save_perturbed(model, path, 0)
    return model


def load_hybrid(tmp_path_factory, variant: str, init: float):
    """(reference, loaded, host, device), both fp32."""
    path = tmp_path_factory.mktemp(f"spec-qwen3_5-{variant}")
    reference = write_qwen3_5(path, variant, init)
    return (reference, *load_fp32(path))


@pytest.fixture(scope="module", params=["dense", "moe"])
def hybrid(request, tmp_path_factory):
    """Peaked logits (initializer 0.1): greedy output varies, so drafts can be wrong."""
    return load_hybrid(tmp_path_factory, request.param, 0.1)


@pytest.fixture(scope="module", params=["dense", "moe"])
def repetitive(request, tmp_path_factory):
    """Flatter logits (initializer 0.02): the continuation of a repeated prompt repeats
    spans of its context, which is what `ngram` drafts from."""
    return load_hybrid(tmp_path_factory, request.param, 0.02)


def plain(hybrid, ids: list[int], n: int = NEW) -> list[int]:
    """Greedy tokens of a run without speculation."""
    (result,) = engine(hybrid).generate([greedy_request("ref", ids, n)])
    return result.token_ids


def run_checked(eng: Engine, requests: list[GenerationRequest]) -> list:
    """Step `requests` to the end, checking after every step that each running sequence's
    state has consumed exactly its computed tokens, and the engine's invariants."""
    results = [eng.add(r) for r in requests]
    while eng.has_work:
        eng.step()
        for seq in eng.scheduler.running:
            assert seq.state_position == seq.num_computed_tokens <= len(seq.token_ids)
        eng.check_invariants()
    assert eng.runtime.states.num_free == eng.runtime.states.num_slots
    return results


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_the_same_with_drafts_accepted_and_rejected(hybrid, k):
    ids = prompt(20, seed=3)
    want = plain(hybrid, ids)
    assert want == reference_greedy(hybrid[0], ids, NEW)
    drafter = ScriptedDrafter([ids + want])
    eng = speculate_with(engine(hybrid), drafter, k)
    (result,) = run_checked(eng, [greedy_request("a", ids, NEW)])
    assert result.token_ids == want
    spec = result.finish.usage.spec
    assert 0 < spec.accepted < spec.drafted  # both paths ran
    # A replay happened: a round began before the previous round's pending token.
    starts = [item.start for item in drafter.inputs]
    assert any(b <= a for a, b in itertools.pairwise(starts))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_is_lossless_on_repeated_text(repetitive, k):
    starts = [prompt(8, seed=1) * 3, prompt(8, seed=5) * 3]
    wants = [plain(repetitive, ids, 40) for ids in starts]
    _, loaded, host, device = repetitive
    spec = SpecConfig(spec="ngram", draft_tokens=k)
    config = EngineConfig(kv_capacity=1024, max_concurrency=4)
    eng = Engine(loaded, config, host=host, device=device, kv_dtype="fp32", spec=spec)
    alone = [run_checked(eng, [greedy_request("a", ids, 40)])[0] for ids in starts]
    together = run_checked(eng, [greedy_request(f"b{i}", ids, 40) for i, ids in enumerate(starts)])
    assert [r.token_ids for r in alone] == [r.token_ids for r in together] == wants
    assert 0 < eng.spec_counters.accepted <= eng.spec_counters.drafted


def test_a_batch_beside_a_prefill_equals_each_alone(hybrid):
    starts = [prompt(20, seed=3), prompt(9, seed=6), prompt(31, seed=7)]
    wants = [plain(hybrid, ids) for ids in starts]
    late_ids = prompt(70, seed=8)
    late_want = plain(hybrid, late_ids, 12)
    drafter = ScriptedDrafter([s + w for s, w in zip(starts, wants, strict=True)], 3)
    eng = speculate_with(engine(hybrid, prefill_chunk=16), drafter, 3)
    results = [eng.add(greedy_request(f"r{i}", ids, NEW)) for i, ids in enumerate(starts)]
    for _ in range(4):
        eng.step()
    late = eng.add(greedy_request("late", late_ids, 12))  # prefilled in chunks beside them
    assert mixed_steps(eng) >= 2
    assert [r.token_ids for r in results] == wants
    assert late.token_ids == late_want
    assert 0 < eng.spec_counters.accepted < eng.spec_counters.drafted
    assert eng.runtime.states.num_free == eng.runtime.states.num_slots


def slot_state(pool: SequenceStatePool, slot: int) -> list[torch.Tensor]:
    """Copies of `slot`'s current state, every tensor of every state layer."""
    row = int(pool.current[slot]) * pool.num_slots + slot
    return [buf[row].clone() for bufs in pool.buffers.values() for buf in bufs]


def test_a_request_that_stops_inside_a_round_ends_with_a_true_state(hybrid, monkeypatch):
    """A stop token accepted as draft 2 of 5: the request ends there, its slot is free,
    and the state it ended with is the state of the tokens `state_position` says, none
    of the drafts after the stop."""
    ids = prompt(20, seed=3)
    want = plain(hybrid, ids)
    # Completion token 0 comes from the prefill; round 1's drafts are tokens 1..5.
    stop = next(m for m in (2, 3, 4) if want[m] not in want[:m])
    ended, original = [], Engine._end

    def end(self, live, reason, events, **kw):  # every end of the engines built below
        seq = live.seq
        if seq.status is SequenceStatus.RUNNING:
            state = slot_state(self.runtime.states, seq.state_slot)
            ended.append((reason, seq.state_position, list(seq.token_ids), state))
        original(self, live, reason, events, **kw)

    monkeypatch.setattr(Engine, "_end", end)
    eng = speculate_with(engine(hybrid), ScriptedDrafter([ids + want], 10**9), 5)
    request = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=NEW,
                                ignore_eos=True, stop_token_ids=[want[stop]])  # fmt: skip
    (result,) = run_checked(eng, [request])
    assert result.token_ids == want[: stop + 1] and result.finish.reason == "stop"
    ((reason, position, tokens, state),) = ended
    assert reason == "stop" and tokens == ids + want[: stop + 1]
    assert position == len(ids)  # the round's start: the prompt, nothing drafted
    # The same state from a fresh run over exactly those tokens.
    ended.clear()
    fresh = speculate_with(engine(hybrid), ScriptedDrafter([]), 1)
    fresh.generate([greedy_request("f", ids, 1)])
    ((_, _, _, theirs_state),) = ended
    for ours, theirs in zip(state, theirs_state, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_with_drafts_is_reproducible(hybrid):
    ids = prompt(20, seed=3)
    want = plain(hybrid, ids)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    runs = []
    for _ in range(2):
        eng = speculate_with(engine(hybrid), ScriptedDrafter([ids + want], 3), 3)
        request = GenerationRequest(ids, params, max_tokens=NEW, ignore_eos=True)
        (result,) = run_checked(eng, [request])
        assert len(result.token_ids) == NEW
        runs.append(result.token_ids)
    assert runs[0] == runs[1]


def test_a_broken_rollback_changes_the_output(hybrid, monkeypatch):
    """The checks above can fail: with `revert` a no-op, the state keeps rejected drafts
    (and a replay runs the accepted tokens through it twice), so the tokens differ."""
    ids = prompt(20, seed=3)
    want = plain(hybrid, ids)
    monkeypatch.setattr(SequenceStatePool, "revert", lambda self, slot: None)
    eng = speculate_with(engine(hybrid), ScriptedDrafter([ids + want], 3), 3)
    (result,) = eng.generate([greedy_request("a", ids, NEW)])
    assert result.token_ids != want


def test_the_plan_says_drafts_need_no_more_state(hybrid, capsys):
    path = str(hybrid[1].path)
    assert main(["plan", path, "--spec", "ngram", "--max-context", "256"]) == 0
    out = capsys.readouterr().out
    assert "sequence states" in out
    line = next(x for x in out.splitlines() if x.startswith("draft rollback"))
    assert "rejected drafts replay from the committed state: no more state" in line
    assert main(["plan", path, "--max-context", "256"]) == 0
    assert "draft rollback" not in capsys.readouterr().out
