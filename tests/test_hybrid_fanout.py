"""`n > 1` and embeddings on a model with state layers: each fork gets a copy of the
prompt's state; an embedding pools hidden states computed through the state layers.

The tiny random Qwen3-Next of test_hybrid_family.py (3 Gated DeltaNet layers, 1 attention
layer, block size 16), fp32, with and without its prefix cache (state snapshots). Completion
i of a seeded request must be what `n = 1` with seed + i gives alone: a fork whose state or
partial page were not its prompt's would drift from it.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import prompt
from hybrid_helpers import load_fp32
from test_engine_fanout import by_index
from test_hybrid_family import write_tiny_qwen3_next

from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.fanout import child_params
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hybrid_and_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-next-fanout")
    reference = write_tiny_qwen3_next(path)
    return load_fp32(path), reference


@pytest.fixture(scope="module")
def hybrid(hybrid_and_reference):
    return hybrid_and_reference[0]


def engine_for(hybrid, **config) -> Engine:
    loaded, host, device = hybrid
    cfg = EngineConfig(**{"kv_capacity": 1024, "max_concurrency": 3, **config})
    return Engine(loaded, cfg, host=host, device=device, kv_dtype="fp32")


def run(engine: Engine, request: GenerationRequest):
    result = engine.add(request)
    while engine.has_work:
        engine.step()
        engine.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 or engine.config.prefix_cache
    return result


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-cache", "snapshots"])
def test_forks_of_a_hybrid_prompt_each_continue_from_its_state(hybrid, prefix_cache):
    ids = prompt(37, 11)
    params = SamplingParams(temperature=0.8, seed=99)
    engine = engine_for(hybrid, prefix_cache=prefix_cache)
    before = engine.counters.prefill_tokens
    req = GenerationRequest(ids, params, max_tokens=8, ignore_eos=True, n=3)
    got, finishes = by_index(run(engine, req), 3)
    assert engine.counters.prefill_tokens - before == len(ids)
    assert all(f.reason == "length" for f in finishes)
    assert len({tuple(t) for t in got}) > 1
    for i in range(3):
        alone = engine_for(hybrid, max_concurrency=1, prefix_cache=False)
        single = GenerationRequest(ids, child_params(params, i), max_tokens=8, ignore_eos=True)
        assert run(alone, single).token_ids == got[i]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_hybrid_embeddings_equal_a_pooling_of_transformers_hidden_states(
    hybrid_and_reference, pooling
):
    hybrid, reference = hybrid_and_reference
    engine = engine_for(hybrid, prefill_chunk=16)  # three chunks, snapshots on
    ids = prompt(41, 12)
    for _ in range(2):  # the second run finds the first one's snapshots and ignores them
        (result,) = engine.generate([GenerationRequest(ids, pooling=pooling)])
        engine.check_invariants()
        with torch.no_grad():
            hidden = reference.model(torch.tensor([ids])).last_hidden_state[0].float()
        want = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        want = torch.nn.functional.normalize(want, dim=0)
        assert (result.finish.embedding - want).abs().max().item() < 1e-4
