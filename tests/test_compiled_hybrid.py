"""The hybrid family's compiled decode step and verifying forward (`--compile-decode`).

The target is a tiny random Qwen3-Next with dense MLPs (3 Gated DeltaNet layers + 1 gated
full-attention layer, partial RoPE) and an "echo" MTP layer that drafts both accepted and
rejected tokens (`test_draft_mtp_hybrid.py`'s), fp32. Its graphs (`model_hybrid/graph.py`)
read the Gated DeltaNet states and return the next ones; the compiled step writes and
commits them (`CompiledDecode`, `CompiledVerify`).

Fast checks run the graphs uncompiled in the compiled steps' places, against a twin
runtime stepping eagerly: a decode step of three sequences at different contexts, and
rounds of different row counts (padded to the width, replayed rows included), compare
logits and the states left in the pool (float, int8 and rk8v4 KV). Slow ones compile:
greedy ids through the engine equal the eager engine's for fp32, bf16, fp16, int8 and
rk8v4 KV, and with `--spec mtp` for fp32, int8 and rk8v4.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import prompt
from hybrid_helpers import greedy_request, load_fp32
from safetensors.torch import load_file, save_file
from test_draft_mtp_hybrid import TARGET_LAYER_SCALE, echo_mtp, write_hybrid

from ninfer_core.engine.compiled_step import CompiledDecode, capture_refusal
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.sequence import Sequence
from ninfer_core.spec.config import SpecConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4
#: Every layer a dense MLP: a sparse MoE picks its experts on the host (refused).
DENSE = {"tie_word_embeddings": True, "mlp_only_layers": [0, 1, 2, 3]}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(loaded, host, device): the dense-MLP tiny Qwen3-Next with the echo MTP layer."""
    from test_hybrid_family import tiny_qwen3_next_config

    path = tmp_path_factory.mktemp("compiled-hybrid")
    write_hybrid(path, 11, echo_mtp(tiny_qwen3_next_config(**DENSE)), **DENSE)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    for name, value in tensors.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            value.mul_(TARGET_LAYER_SCALE)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return load_fp32(path)


def twins(hybrid, kv: str = "fp32"):
    """Two runtimes of the model: one steps eagerly, the other through the graphs,
    uncompiled (the compiled steps with their functions swapped for the graphs)."""
    loaded, host, device = hybrid
    spec = RuntimeSpec(64, 16, kv_dtype=kv, max_sequences=4)
    eager, graph = (build_runtime(loaded, host, device, spec) for _ in range(2))
    runner, model = graph.runner, loaded.model
    runner.compiled = CompiledDecode(model, runner.kv_store, 16, 4, runner.states)
    runner.compiled._fn = model.decode_graph
    assert runner.compile_rounds(3) is None
    runner.verify._fn = model.verify_graph
    return eager.runner, runner


def start(runner, prompts: list[list[int]]) -> list[Sequence]:
    """Each prompt prefilled (eagerly: one sequence a step), its first token appended."""
    seqs = []
    for ids in prompts:
        seq = Sequence(list(ids))
        seq.state_slot = runner.states.allocate()
        seq.append_token(int(runner.run([(seq, len(ids))])[0].argmax()))
        seqs.append(seq)
    return seqs


def states_of(runner, seqs: list[Sequence]) -> list[dict]:
    return [runner.states.save(seq.state_slot) for seq in seqs]


def assert_same_states(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for layer in g:
            for a, b in zip(g[layer], w[layer], strict=True):
                assert (a - b).abs().max().item() <= TOL


def test_the_family_offers_both_graphs_and_moe_models_are_refused_with_the_reason(hybrid):
    loaded = hybrid[0]
    assert loaded.model.decode_graph is not None and loaded.model.verify_graph is not None
    store = build_runtime(loaded, hybrid[1], hybrid[2], RuntimeSpec(8, 16)).kv_store
    assert capture_refusal(loaded.model, store) is None

    class Moe(torch.nn.Module):
        decode_graph = True

        def __init__(self) -> None:
            super().__init__()
            from ninfer_core.model.moe import SparseMoE

            self.mlp = SparseMoE.__new__(SparseMoE)
            torch.nn.Module.__init__(self.mlp)

    assert "sparse MoE" in capture_refusal(Moe(), store)


#: KV codecs the fast checks run over: float, and the coded stores whose own rows the
#: graphs read as they will be stored (int8; rk8v4 rotated, V in 4 bits).
CODECS = ["fp32", "int8", "rk8v4"]


@pytest.mark.parametrize("kv", CODECS)
def test_a_decode_step_at_different_contexts_gives_the_eager_logits_and_states(hybrid, kv):
    eager, graph = twins(hybrid, kv)
    prompts = [prompt(5, seed=1), prompt(16, seed=2), prompt(33, seed=3)]
    a, b = start(eager, prompts), start(graph, prompts)
    for _ in range(3):  # the K/V and states each step stores feed the next
        want = eager.run([(s, 1) for s in a])
        got = graph.run([(s, 1) for s in b])
        assert (got - want).abs().max().item() <= TOL
        assert_same_states(states_of(graph, b), states_of(eager, a))
        for s, t in zip(a + b, torch.cat((want, got)).argmax(-1).tolist(), strict=True):
            s.append_token(t)
    assert graph.compiled.steps == 3


@pytest.mark.parametrize("kv", CODECS)
def test_rounds_of_different_row_counts_leave_the_eager_logits_and_states(hybrid, kv):
    """Rows 4, 2 and 1 at width 4 (padded), then a step replaying 3 pending tokens: every
    row's logits, and the states after each sequence's real rows."""
    eager, graph = twins(hybrid, kv)
    prompts = [prompt(9, seed=4), prompt(20, seed=5), prompt(17, seed=6)]
    a, b = start(eager, prompts), start(graph, prompts)
    for counts in ([4, 2, 1], [3, 4, 2]):
        for seqs in (a, b):
            for s, n in zip(seqs, counts, strict=True):
                s.draft_ids = prompt(n - 1, seed=n)  # the rows a round verifies
        want = eager.step([(s, len(s.draft_ids) + 1) for s in a])
        got = graph.step([(s, len(s.draft_ids) + 1) for s in b])
        assert (got.logits - want.logits).abs().max().item() <= TOL
        assert_same_states(states_of(graph, b), states_of(eager, a))
        for s in a + b:  # every draft kept, then the next token
            s.token_ids.extend(s.draft_ids)
            s.draft_ids = []
            s.append_token(7)
    assert graph.verify.steps == 2
    # A replay: three pending tokens, no drafts (as after a round that rejected one and
    # was rolled back), in a step that keeps the hidden states (an MTP drafter's).
    for runner, seqs in ((eager, a), (graph, b)):
        runner.keep_hidden = True
        for s in seqs:
            runner.states.revert(s.state_slot)  # the state before the last round
            s.num_computed_tokens = s.state_position = len(s.token_ids) - 3
    want, got = eager.step([(s, 3) for s in a]), graph.step([(s, 3) for s in b])
    assert got.logits.shape == (3, want.logits.shape[1]) and graph.verify.steps == 3
    assert (got.logits - want.logits).abs().max().item() <= TOL
    assert (got.hidden - want.hidden).abs().max().item() <= TOL
    assert_same_states(states_of(graph, b), states_of(eager, a))


def run(hybrid, prompts, compile_decode: bool, kv: str, spec: SpecConfig | None = None):
    loaded, host, device = hybrid
    cfg = EngineConfig(kv_capacity=1024, max_concurrency=2)
    engine = Engine(loaded, cfg, host=host, device=device, kv_dtype=kv, spec=spec, seed=0,
                    compile_decode=compile_decode)  # fmt: skip
    requests = [greedy_request(f"r{i}", p, 24) for i, p in enumerate(prompts)]
    return [r.token_ids for r in engine.generate(requests)], engine


PROMPTS = [prompt(21, seed=12), prompt(8, seed=13)]


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp16", "int8", "rk8v4"])
def test_compiled_greedy_ids_are_the_eager_ones(hybrid, kv):
    want, _ = run(hybrid, PROMPTS, False, kv)
    got, engine = run(hybrid, PROMPTS, True, kv)
    assert got == want
    compiled = engine.runner.compiled
    assert compiled.steps > 0 and compiled.failed is None
    assert len(set(want[0])) > 5


@pytest.mark.slow
@pytest.mark.parametrize("kv", CODECS)
def test_compiled_rounds_with_mtp_give_the_eager_greedy_ids(hybrid, kv):
    want, _ = run(hybrid, PROMPTS, False, kv)
    got, engine = run(hybrid, PROMPTS, True, kv, SpecConfig(spec="mtp", draft_tokens=3))
    assert got == want
    verify = engine.runner.verify
    assert verify.steps > 0 and verify.failed is None
    counters = engine.spec_counters
    assert 0 < counters.accepted < counters.drafted  # rounds accepted and rolled back
