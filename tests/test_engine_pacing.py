"""Prefill pacing (`engine/pacing.py`): a stream decoding beside long prompts or a flood of
embedding inputs keeps its share of the engine's time.

The tiny fp32 Qwen3 of `engine_helpers` runs for real; the engine's clock is simulated, and
each step advances it by what such a step costs on a device (`STEP_COSTS`: a decode step,
plus so much per prefill token), so that the stream's rate in engine time is exact and the
same on any machine. The victim's rate beside the flood is compared with its rate alone.
"""

from __future__ import annotations

import itertools

import pytest
from engine_helpers import prompt, tiny_engine

from ninfer_core.engine.pacing import STALL_STEPS, PrefillPacing
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: (seconds per step with no prefill, seconds per prefill token): a CPU with a small model,
#: and a GPU where prefill tokens are cheap against the step.
STEP_COSTS = {"cpu": (0.010, 0.001), "gpu": (0.020, 0.0001)}


class SimulatedClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulated_engine(engine_model, costs: tuple[float, float], **config):
    """An engine whose clock moves by `costs` for each batch its runner runs."""
    clock = SimulatedClock()
    engine = tiny_engine(engine_model, clock=clock, max_concurrency=2, kv_capacity=2048,
                         **config)  # fmt: skip
    run = engine.runner.step
    step_s, token_s = costs

    def step(batch):
        prefill = sum(n for seq, n in batch if seq.is_prefilling)  # before the run moves them
        out = run(batch)
        clock.now += step_s + token_s * prefill
        return out

    engine.runner.step = step
    return engine, clock


def victim_rate(engine, clock, victim_id: str, tokens: int) -> tuple[float, list[float]]:
    """Steps the engine until the victim has `tokens` tokens; its tokens per engine second
    (after the first) and the gaps between them."""
    stamps: list[float] = []
    while len(stamps) < tokens:
        out = engine.step()
        if victim_id in out.decode:
            stamps.append(clock.now)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), gaps


def victim_request() -> GenerationRequest:
    return GenerationRequest(prompt(8, seed=1), GREEDY, max_tokens=80, ignore_eos=True)


def flood(engine, kind: str) -> list:
    """Long work beside the victim: embedding inputs (prefill only) or long prompts."""
    if kind == "embeddings":
        return [
            engine.add(GenerationRequest(prompt(400, seed=20 + i), pooling="last"))
            for i in range(6)
        ]
    return [
        engine.add(GenerationRequest(prompt(400, seed=20 + i), GREEDY, max_tokens=2))
        for i in range(6)
    ]


def rates(engine_model, device: str, kind: str, **config) -> tuple[float, float, list[float]]:
    """The victim's rate alone and beside `kind`, and its gaps beside it."""
    engine, clock = simulated_engine(engine_model, STEP_COSTS[device], **config)
    alone = engine.add(victim_request())
    solo, _ = victim_rate(engine, clock, alone.request_id, 30)
    while engine.has_work:
        engine.step()
    victim = engine.add(victim_request())
    engine.step()  # its prompt
    work = flood(engine, kind)
    beside, gaps = victim_rate(engine, clock, victim.request_id, 60)
    while engine.has_work:
        engine.step()
    assert all(h.finish is not None and h.finish.reason != "error" for h in work)
    return solo, beside, gaps


@pytest.mark.parametrize("device", sorted(STEP_COSTS))
@pytest.mark.parametrize("kind", ["embeddings", "prompts"])
def test_a_stream_keeps_half_its_rate_beside_a_flood(engine_model, device, kind):
    solo, beside, gaps = rates(engine_model, device, kind)
    assert beside >= 0.5 * solo * 0.98, (solo, beside)
    # no gap longer than a prefill cut to STALL_STEPS decode steps, and a block's worth
    step_s, token_s = STEP_COSTS[device]
    longest = step_s * (1 + STALL_STEPS) + token_s * 16
    assert max(gaps) <= longest * 1.25, (max(gaps), longest)


def test_without_pacing_the_same_flood_slows_the_stream_far_more(engine_model):
    """The check above can fail: with pacing off, every step carries a full prefill chunk."""
    solo, beside, _ = rates(engine_model, "cpu", "embeddings", decode_share=0.0)
    assert beside < 0.3 * solo, (solo, beside)


def test_a_higher_share_gives_the_stream_more(engine_model):
    solo, half, _ = rates(engine_model, "cpu", "prompts", decode_share=0.5)
    _, most, _ = rates(engine_model, "cpu", "prompts", decode_share=0.8)
    assert most >= 0.8 * solo * 0.98 and most > half, (solo, half, most)


def test_a_lone_prompt_takes_the_whole_budget():
    pacing = PrefillPacing(0.5)
    pacing.observe(0, 1, 0.010)
    pacing.observe(16, 0, 0.026)  # a prompt alone: 1 ms a token beyond the step
    assert pacing.prefill_tokens(decoding=False, budget=1024, floor=16) == 1024
    # beside a stream: about STALL_STEPS decode steps of prefill (0.04 s at 1 ms a token)
    assert pacing.prefill_tokens(decoding=True, budget=1024, floor=16) == 40


def test_prefill_time_is_owed_and_decode_steps_pay_it_back():
    pacing = PrefillPacing(0.5)
    pacing.observe(0, 1, 0.010)
    pacing.observe(40, 1, 0.050)  # 0.04 s of prefill, 0.01 of it paid by its own decode
    assert pacing.debt_s == pytest.approx(0.030)
    assert pacing.prefill_tokens(decoding=True, budget=1024, floor=16) == 0
    for _ in range(3):
        pacing.observe(0, 1, 0.010)
    assert pacing.debt_s == pytest.approx(0.0, abs=1e-12)
    assert pacing.prefill_tokens(decoding=True, budget=1024, floor=16) > 0
    pacing.observe(40, 0, 0.040)  # nothing decoding: nothing owed
    assert pacing.debt_s == 0.0


@pytest.mark.parametrize("share", [-0.1, 1.0, 2.0])
def test_a_share_outside_its_range_is_refused(share):
    with pytest.raises(ValueError, match="decode_share"):
        PrefillPacing(share)
