"""The sampler is total: whatever the logits and parameters, every id is in [0, V), and a row's
id depends only on that row (NaN/inf handled deterministically, as `sanitize` documents).

The references are plain Python over the row's values: "the best finite value", "never a NaN
or -inf position", "id 0 when nothing is possible". The old sampler drew id V (one past the
vocabulary) from any row holding a NaN, which the next forward turned into an IndexError.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from ninfer_core.sampling import Sampler, SamplingParams, SequenceTokens
from ninfer_core.sampling.params import (
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
)

NAN, INF = float("nan"), float("inf")
V = 12


def histories(n: int) -> list[SequenceTokens]:
    return [SequenceTokens([1, 2, 3], [4, 5]) for _ in range(n)]


def best_finite(row: list[float]) -> int:
    """Independent reference for a greedy pick: the first +inf, else the first largest finite
    value, else 0 (nothing possible)."""
    if INF in row:
        return row.index(INF)
    finite = [(v, -i) for i, v in enumerate(row) if math.isfinite(v)]
    return -max(finite)[1] if finite else 0


def possible(row: list[float]) -> set[int]:
    """Positions a draw may land on: +inf ones if any, else the finite ones, else {0}."""
    if INF in row:
        return {i for i, v in enumerate(row) if v == INF}
    finite = {i for i, v in enumerate(row) if math.isfinite(v)}
    return finite or {0}


ROWS = {
    "one nan": [0.5, NAN, 2.0, 1.0] + [0.0] * (V - 4),
    "all nan": [NAN] * V,
    "all -inf": [-INF] * V,
    "nan and -inf": [NAN, -INF] * (V // 2),
    "one +inf": [1.0] * 5 + [INF] + [2.0] * (V - 6),
    "two +inf": [INF, 0.0, INF] + [NAN] * (V - 3),
    "huge": [3e38, -3e38, 1e38] + [0.0] * (V - 3),
    "one finite": [NAN] * (V - 1) + [-7.0],
}


@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=MIN_REPETITION_PENALTY),
        SamplingParams(temperature=1e-5, seed=3),  # smallest non-greedy: overflows 3e38
        SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.2, seed=1),
        SamplingParams(temperature=MAX_TEMPERATURE, presence_penalty=2, frequency_penalty=-2),
        SamplingParams(temperature=0.7, repetition_penalty=MIN_REPETITION_PENALTY),
        SamplingParams(temperature=0.7, repetition_penalty=MAX_REPETITION_PENALTY),
    ],
    ids=["greedy", "greedy-rep", "t-min", "filters", "t-max-pen", "rep-min", "rep-max"],
)
def test_hostile_rows_give_an_id_in_range_and_never_an_impossible_one(name, params):
    row = ROWS[name]
    logits = torch.tensor([row, [0.0] * V])  # a healthy neighbour shares the batch
    sampler = Sampler(seed=0)
    tokens = sampler.sample(logits, [params, params], histories(2)).tolist()
    assert all(0 <= t < V for t in tokens)
    if not params.has_penalties:  # penalties move values; without them the pick is exact
        if params.greedy:
            assert tokens[0] == best_finite(row)
        assert tokens[0] in possible(row)
    elif not any(math.isfinite(v) or v == INF for v in row):
        assert tokens[0] == 0  # nothing possible: the documented fallback
    probs = sampler.probabilities(logits, [params, params], histories(2))
    assert not probs.isnan().any() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert int(probs[0].nonzero().flatten().max()) < V


def test_a_row_with_nothing_possible_falls_back_to_id_0_in_every_path():
    dead = torch.full((1, V), NAN)
    every_path = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=2),
    ]
    for params in every_path:
        assert Sampler(seed=1).sample(dead, [params], histories(1)).tolist() == [0]
        probs = Sampler().probabilities(dead, [params], histories(1))
        assert probs[0, 0] == 1 and probs[0, 1:].sum() == 0


def test_nan_never_changes_a_healthy_neighbours_draw():
    """A seeded row's token depends on its own row only, whatever its neighbour holds."""
    healthy = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=1.0, seed=12)]
    alone = Sampler().sample(torch.cat([healthy, healthy]), params, histories(2))[1]
    for row in ROWS.values():
        both = torch.cat([torch.tensor([row]), healthy])
        assert Sampler().sample(both, params, histories(2))[1] == alone


def test_random_hostile_batches_stay_in_range_and_are_deterministic():
    rng = random.Random(7)
    specials = [NAN, INF, -INF, 3.4e38, -3.4e38, 1e-45, 0.0]
    for _ in range(60):
        b = rng.randrange(1, 5)
        rows = [
            [rng.choice(specials) if rng.random() < 0.4 else rng.gauss(0, 30) for _ in range(V)]
            for _ in range(b)
        ]
        params = [
            SamplingParams(
                temperature=rng.choice([0, 1e-5, 0.3, 1.0, MAX_TEMPERATURE]),
                top_k=rng.choice([0, 1, 3, MAX_TOP_K]),
                top_p=rng.choice([1.0, 0.5, 1e-9]),
                min_p=rng.choice([0.0, 0.5, 1.0]),
                repetition_penalty=rng.choice(
                    [1.0, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]
                ),
                presence_penalty=rng.choice([0, 2, -2]),
                frequency_penalty=rng.choice([0, 2, -2]),
                seed=rng.randrange(2**64),
            )
            for _ in range(b)
        ]
        logits = torch.tensor(rows)
        first = Sampler().sample(logits, params, histories(b)).tolist()
        assert all(0 <= t < V for t in first), (rows, params)
        assert Sampler().sample(logits, params, histories(b)).tolist() == first
        # Nothing makes an impossible (NaN, -inf) token possible; id 0 is the only fallback.
        for t, row in zip(first, rows, strict=True):
            assert t == 0 or not (math.isnan(row[t]) or row[t] == -INF), (row, t)
        torch.testing.assert_close(logits, torch.tensor(rows), equal_nan=True)  # not in place


@pytest.mark.parametrize(
    "edge",
    [
        {"temperature": MAX_TEMPERATURE},
        {"repetition_penalty": MIN_REPETITION_PENALTY},
        {"repetition_penalty": MAX_REPETITION_PENALTY},
        {"top_k": MAX_TOP_K},
        {"seed": 2**64 - 1},
        {"seed": -(2**63)},
        {"presence_penalty": -2, "frequency_penalty": 2},
    ],
)
def test_the_edges_of_each_range_are_accepted_and_sample(edge):
    params = SamplingParams(**edge)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 50
    assert 0 <= int(Sampler().sample(logits, [params], histories(1))[0]) < V


def test_the_issue_reproduction_is_refused_with_the_field_named():
    """repetition_penalty=1e-45 underflowed to 0 in fp32 and made the logits inf/NaN."""
    with pytest.raises(ValueError, match=r"^repetition_penalty must be in"):
        SamplingParams(repetition_penalty=1e-45)
