"""Per-sequence state layers through the engine, on the toy recurrent family (toy_recurrent.py).

The family declares a `SequenceState` for its recurrent layers and `PagedKV` for its
attention layers; the planner, the runtime's allocation and admission read that one
declaration. Checked against `reference_logits`, the same model in float64 without a cache.
"""

from __future__ import annotations

import json

import pytest
from engine_helpers import prompt
from toy_recurrent import PLUGIN, reference_logits, write_toy_model

from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.scheduler import Scheduler
from ninfer_core.engine.sequence import Sequence
from ninfer_core.kv.state import SequenceStatePool
from ninfer_core.loading import load_model
from ninfer_core.model.caches import caches_for
from ninfer_core.plugin_host import create_host
from ninfer_core.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(path, loaded, host, device): the toy model, loaded in fp32."""
    path = write_toy_model(tmp_path_factory.mktemp("toy-recurrent"))
    host = create_host(extra_plugins=[("toy-recurrent", PLUGIN)])
    device = probe_device(use_cuda=False)
    loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    return path, loaded, host, device


def engine(toy, **config) -> Engine:
    _, loaded, host, device = toy
    cfg = EngineConfig(**{"kv_capacity": 1024, "max_concurrency": 4, **config})
    return Engine(loaded, cfg, host=host, device=device, kv_dtype="fp32")


def request(rid: str, ids: list[int], max_tokens: int = 12) -> GenerationRequest:
    params = SamplingParams(temperature=0.0)
    return GenerationRequest(ids, params, max_tokens=max_tokens, ignore_eos=True, request_id=rid)


def greedy_reference(path, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(reference_logits(path, out)[-1].argmax()))
    return out[len(ids) :]


def test_the_declaration_gives_a_pool_of_attention_layers_and_a_state_pool(toy):
    _, loaded, host, device = toy
    caches = caches_for(loaded.family, loaded.config)
    assert caches.paged_layers == [1, 3] and sorted(caches.state_layers) == [0, 2]
    rt = build_runtime(loaded, host, device, RuntimeSpec(8, 16, prefix_cache=True, max_sequences=3))
    assert rt.layout.num_layers == 2  # only the attention layers keep pages
    assert rt.states is not None and rt.states.num_slots == 3
    assert rt.states.nbytes == 2 * 3 * 2 * 24 * 4  # layers x slots x both buffers x S fp32
    assert rt.block_manager.cache is None  # a prefix hit would skip the tokens a state needs


def test_prefill_logits_match_a_float64_reference_without_cache(toy):
    path, loaded, host, device = toy
    ids = prompt(37, seed=1)
    runner = build_runtime(loaded, host, device, RuntimeSpec(8, 16, kv_dtype="fp32")).runner
    seq = Sequence(ids)
    seq.state_slot = runner.states.allocate()
    ours = runner.run([(seq, len(ids))], all_tokens=True)
    ref = reference_logits(path, ids).float()
    assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_output_matches_the_reference(toy):
    path = toy[0]
    ids = prompt(20, seed=2)
    (result,) = engine(toy).generate([request("a", ids, max_tokens=10)])
    assert result.token_ids == greedy_reference(path, ids, 10)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_concurrent_sequences_equal_each_run_alone(toy, n):
    prompts = [prompt(9 + 7 * i, seed=10 + i) for i in range(n)]
    alone = [
        engine(toy).generate([request(f"r{i}", p)])[0].token_ids for i, p in enumerate(prompts)
    ]
    eng = engine(toy, max_concurrency=4)
    together = eng.generate([request(f"r{i}", p) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in together] == alone
    eng.check_invariants()
    assert eng.runtime.states.num_free == 4


def test_chunked_prefill_equals_one_shot(toy):
    ids = prompt(53, seed=3)
    one_shot = engine(toy, prefill_chunk=1024).generate([request("a", ids)])[0].token_ids
    # 5-token chunks, beside a decoding sequence: the state carries across chunks.
    eng = engine(toy, prefill_chunk=5)
    other, chunked = eng.generate([request("b", prompt(4, seed=4)), request("a", ids)])
    assert chunked.token_ids == one_shot
    assert other.token_ids == engine(toy).generate([request("b", prompt(4, seed=4))])[0].token_ids


def test_cancel_frees_the_state_slot_and_the_next_sequence_starts_from_zero(toy):
    eng = engine(toy, max_concurrency=2)
    a, b = (
        eng.add(request("a", prompt(12, seed=5), 40)),
        eng.add(request("b", prompt(8, seed=6), 40)),
    )
    for _ in range(4):
        eng.step()
    assert eng.runtime.states.num_free == 0
    eng.cancel("a")
    eng.step()
    assert eng.runtime.states.num_free == 1
    eng.check_invariants()
    # The freed slot held a's state: the next sequence must not see it.
    ids = prompt(15, seed=7)
    c = eng.add(request("c", ids, 12))
    while eng.has_work:
        eng.step()
    assert a.finish.reason == "cancelled" and b.finish.reason == "length"
    assert c.token_ids == engine(toy).generate([request("c", ids, 12)])[0].token_ids
    assert eng.runtime.states.num_free == 2
    eng.check_invariants()


def test_admission_waits_for_a_free_state_slot(toy):
    _, loaded, _, _ = toy
    caches = caches_for(loaded.family, loaded.config)
    pool = SequenceStatePool(caches, 1, "cpu")
    sched = Scheduler(EngineConfig(max_concurrency=2), BlockManager(64, 16), pool)
    first, second = Sequence(prompt(5, 1), max_tokens=4), Sequence(prompt(5, 2), max_tokens=4)
    sched.add(first, 0.0, None, None)
    sched.add(second, 0.0, None, None)
    out = sched.schedule(0.0)
    assert out.admitted == [first] and list(sched.waiting) == [second]
    sched.finish(first)
    assert sched.schedule(0.0).admitted == [second] and second.state_slot == 0


def test_a_forward_that_fails_half_way_leaves_every_state_as_it_was(toy, monkeypatch):
    """The engine re-runs a failed step sequence by sequence (faults.py); the states of the
    failed forward must not have moved, or the re-run would apply an update twice."""
    prompts = [prompt(11, seed=20), prompt(6, seed=21)]
    clean = [
        r.token_ids
        for r in engine(toy).generate([request(f"r{i}", p) for i, p in enumerate(prompts)])
    ]
    eng = engine(toy)
    layer = eng.runtime.runner.model.layers[3]  # after both recurrent layers wrote
    original, calls = layer.forward, {"n": 0}

    def flaky(x, *args):
        calls["n"] += 1
        if calls["n"] == 3 and x.shape[0] == 2:  # the third step, a two-sequence decode
            raise RuntimeError("injected")
        return original(x, *args)

    monkeypatch.setattr(layer, "forward", flaky)
    results = eng.generate([request(f"r{i}", p) for i, p in enumerate(prompts)])
    assert calls["n"] > 3
    assert [r.token_ids for r in results] == clean


def test_plan_counts_state_bytes_times_max_concurrency(toy, monkeypatch, capsys):
    path = toy[0]
    import ninfer_core.plugin_host as plugin_host

    real = plugin_host.create_host
    monkeypatch.setattr(
        plugin_host,
        "create_host",
        lambda **kw: real(extra_plugins=[("toy-recurrent", PLUGIN)], **kw),
    )
    for concurrency in (1, 3):
        assert main(["plan", str(path), "--max-concurrency", str(concurrency), "--json",
                     "--max-context", "256", "--kv-dtype", "fp16"]) == 0  # fmt: skip
        plan = json.loads(capsys.readouterr().out)
        per_seq = 2 * 2 * 24 * 4  # 2 state layers x both buffers x 24 fp32
        assert plan["state_bytes_per_sequence"] == per_seq
        assert plan["state_bytes"] == concurrency * per_seq
        assert [x["kind"] for x in plan["kv_layers"]] == ["state", "paged", "state", "paged"]
        # 2 paged layers x K and V x 2 KV heads x 8 dims x fp16
        assert plan["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 2
    assert main(["plan", str(path), "--max-concurrency", "3", "--max-context", "256"]) == 0
    assert "sequence states" in capsys.readouterr().out
