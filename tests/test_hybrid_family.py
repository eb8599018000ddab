"""The `qwen3-next` family (ninfer_plugins/model_hybrid) against transformers.

A tiny random Qwen3-Next (3 Gated DeltaNet layers + 1 gated full-attention layer, Hv =
2 x Hqk, 4 experts with top-2 and a shared expert, one dense `mlp_only` layer, partial
RoPE) is built by transformers from a seed and saved with `save_pretrained`; every
weight that transformers initialises to a constant (the zero-centred norms, A_log,
dt_bias, the gated norm) is perturbed first, so a wrong `1 + w` or a swapped gate cannot
pass. Our loader, runner and engine must give its logits and its greedy tokens.
"""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import prompt
from hybrid_helpers import (
    LAYER_TYPES,
    TOL,
    check_chunked_prefill_then_decode,
    check_greedy_generation,
    check_one_shot_prefill,
    engine,
    greedy_request,
    load_fp32,
    new_sequence,
    reference_logits,
    runner_for,
    save_perturbed,
)
from safetensors.torch import load_file, save_file

from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import convert
from ninfer_core.device import probe_device
from ninfer_core.errors import ModelLoadError
from ninfer_core.eval_ppl import eval_ppl, sequence_logits
from ninfer_core.loading import load_model
from ninfer_core.model.caches import PagedKV, SequenceState, caches_for
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_plugins.model_hybrid import HybridConfig, HybridDecoder, Qwen3NextFamily
from ninfer_plugins.model_hybrid.model import planned_weights, weight_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_qwen3_next_config(**overrides):
    from transformers import Qwen3NextConfig

    fields = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        # Wider than 0.02 so logits are peaked and greedy output varies.
        initializer_range=0.1,
    )
    config = Qwen3NextConfig(**{**fields, **overrides})
    config._experts_implementation = "eager"
    config._attn_implementation = "eager"
    return config


def write_tiny_qwen3_next(path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Save a seeded random Qwen3NextForCausalLM (fp32), a tokenizer and a few `mtp.*`
    tensors (real checkpoints carry the MTP head; the model must not load it) to `path`;
    return the model, in eval mode. `overrides`: `Qwen3NextConfig` fields."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(tiny_qwen3_next_config(**overrides)).eval()
    save_perturbed(model, path, seed)
    h = model.config.hidden_size
    g = torch.Generator().manual_seed(seed + 2)
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g), "mtp.norm.weight": torch.ones(h)}
    save_file(mtp, str(path / "mtp.safetensors"))
    return model


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(reference, loaded, host, device): transformers' model and ours, both fp32."""
    path = tmp_path_factory.mktemp("qwen3-next")
    reference = write_tiny_qwen3_next(path)
    return (reference, *load_fp32(path))


def test_the_family_declares_paged_attention_and_state_layers(hybrid):
    _, loaded, _, _ = hybrid
    assert loaded.family.name == "qwen3-next" and isinstance(loaded.model, HybridDecoder)
    caches = caches_for(loaded.family, loaded.config)
    assert caches.paged_layers == [2] and sorted(caches.state_layers) == [0, 1, 3]
    assert caches.layers[2] == PagedKV(2, 16)
    state = caches.layers[0]
    assert isinstance(state, SequenceState)
    # conv over q|k|v: 2 * (2 x 8) + 4 x 12 channels, K - 1 = 3 columns; S: [Hv, Dk, Dv]
    assert [t.shape for t in state.tensors] == [(80, 3), (4, 8, 12)]
    assert all(t.dtype == torch.float32 for t in state.tensors)


def test_one_shot_prefill_matches_transformers(hybrid):
    check_one_shot_prefill(hybrid)


def test_uneven_chunked_prefill_then_decode_matches_transformers(hybrid):
    check_chunked_prefill_then_decode(hybrid)


def test_greedy_generation_matches_transformers_generate(hybrid):
    check_greedy_generation(hybrid, 32)


def test_two_concurrent_sequences_equal_each_run_alone(hybrid):
    prompts = [prompt(23, seed=4), prompt(9, seed=5)]
    alone = [engine(hybrid).generate([greedy_request(f"r{i}", p, 12)])[0].token_ids
             for i, p in enumerate(prompts)]  # fmt: skip
    # 7-token prefill chunks: one sequence decodes while the other is still prefilling.
    eng = engine(hybrid, prefill_chunk=7)
    together = eng.generate([greedy_request(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in together] == alone
    eng.check_invariants()
    assert eng.runtime.states.num_free == 4


def test_a_dense_tied_full_rotary_variant_matches_transformers(tmp_path):
    """No experts (every MLP dense), a tied head, RoPE over the whole head, Hv = Hqk, and
    the layer kinds from `full_attention_interval` instead of `layer_types`."""
    reference = write_tiny_qwen3_next(
        tmp_path, seed=7, num_experts=0, tie_word_embeddings=True, layer_types=None,
        full_attention_interval=2, linear_num_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    config = json.loads((tmp_path / "config.json").read_text())
    # transformers writes the list it derived and drops the interval: as older configs
    config.pop("layer_types")
    config["full_attention_interval"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    hybrid = (reference, *load_fp32(tmp_path))
    loaded = hybrid[1]
    assert loaded.model.hybrid.layer_types == ("linear_attention", "full_attention") * 2
    assert caches_for(loaded.family, loaded.config).paged_layers == [1, 3]
    ids = prompt(27, seed=8)
    ref = reference_logits(reference, ids)
    runner = runner_for(hybrid)
    seq = new_sequence(runner, ids)
    ours = torch.cat([runner.run([(seq, 24)], all_tokens=True)]
                     + [runner.run([(seq, 1)]) for _ in range(3)])  # fmt: skip
    assert (ours - ref).abs().max().item() <= TOL


def raw_config(**changes) -> dict:
    raw = tiny_qwen3_next_config().to_dict()
    raw["architectures"] = ["Qwen3NextForCausalLM"]
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def test_config_reads_the_v4_spellings():
    """Hub configs written before transformers 5: `partial_rotary_factor` and
    `rope_theta` at the top level, no `layer_types` (every 4th layer full)."""
    raw = raw_config(layer_types=None, rope_parameters=None, rope_theta=1e7,
                     partial_rotary_factor=0.5, num_hidden_layers=8)  # fmt: skip
    config = Qwen3NextFamily().parse_config(raw)
    hybrid = HybridConfig.from_model_config(config)
    assert hybrid.rotary_dim == 8 and config.rope_theta == 1e7
    assert [i for i in range(8) if not hybrid.is_linear(i)] == [3, 7]
    assert hybrid.rope_config().head_dim == 8


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 4}, "layer_types"),
        ({"layer_types": ["mamba"] * 4}, "layer_types"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_a_bad_hybrid_field_is_named(changes, named):
    with pytest.raises(ModelLoadError, match=named):
        Qwen3NextFamily().parse_config(raw_config(**changes))


def test_the_planned_weight_count_is_the_plans(hybrid):
    hybrid_config = hybrid[1].model.hybrid
    plan = weight_plan(hybrid_config)
    assert planned_weights(hybrid_config) == sum(math.prod(s.shape) for s in plan)
    assert not any(s.hf_name.startswith("mtp.") for s in plan)


def test_too_few_weights_for_the_config_are_refused_first(hybrid, tmp_path):
    source = hybrid[1].path
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 400, LAYER_TYPES * 100
    (tmp_path / "config.json").write_text(json.dumps(config))
    host, device = create_host(), probe_device(use_cuda=False)
    with pytest.raises(ModelLoadError, match="the config does not match the weights"):
        load_model(tmp_path, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))


def test_a_missing_tensor_is_named_before_anything_loads(hybrid, tmp_path):
    source = hybrid[1].path
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "mtp.safetensors"):
        shutil.copy(source / name, tmp_path / name)  # mtp.*: enough weights in total
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.3.linear_attn.A_log"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    host, device = create_host(), probe_device(use_cuda=False)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.linear_attn\.A_log"):
        load_model(tmp_path, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))


def test_perplexity_windows_each_start_from_a_zero_state(hybrid):
    """`eval_ppl` scores windows one after another through one runtime: each window's
    sequence gets a freshly zeroed state slot, so it scores as transformers does alone."""
    reference, loaded, host, device = hybrid
    ids = prompt(50, seed=9)
    expected = 0.0
    for window in (ids[:25], ids[25:]):
        logits = reference_logits(reference, window)[:-1].double()
        expected += float(F.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum"))
    result = eval_ppl(loaded, ids, context=25, host=host, device=device)
    assert result.windows == 2 and result.tokens == 48
    assert result.nll == pytest.approx(expected, rel=1e-5)


def test_a_w8_container_matches_transformers_on_its_dequantized_weights(hybrid, tmp_path):
    """Converted to `.ninfer` with every matrix W8G32 (experts and router included), the
    model loads the quantized matrices (the backend packs them as it likes) and matches
    transformers given the same weights dequantized: the quantized path adds no error of
    its own. (Against the fp32 weights a W8 tiny hybrid drifts by about 1 logit: the
    routing and the recurrence amplify rounding, as they do in transformers.)"""
    reference, _, host, device = hybrid
    out = tmp_path / "model.ninfer"
    convert(hybrid[1].path, out, recipe_name="w8")
    loaded = load_model(out, host=host, device=device, runtime=RuntimeConfig(dtype="fp32"))
    for name in ("linear_attn.in_proj_qkvz.weight", "mlp.experts.1.down_proj.weight"):
        assert isinstance(loaded.artifact.load_weight("model.layers.0." + name), QuantizedTensor)
    dequantized = copy.deepcopy(reference)
    load_dequantized(dequantized, loaded.artifact)
    ids = prompt(30, seed=10)
    ours = sequence_logits(loaded, ids)
    assert (ours - reference_logits(dequantized, ids)).abs().max().item() <= TOL


@torch.no_grad()
def load_dequantized(model: torch.nn.Module, artifact) -> None:
    """Copy every tensor of `artifact`, dequantized to fp32, into transformers' `model`;
    per-expert matrices go into its stacked `experts.gate_up_proj` / `down_proj`."""
    params = model.state_dict()
    for name in artifact.tensor_names():
        w = artifact.load_weight(name)
        w = w.dequantize(torch.float32) if isinstance(w, QuantizedTensor) else w.float()
        prefix, _, rest = name.partition(".experts.")
        if rest and rest.split(".")[0].isdigit():
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            if proj == "down_proj":
                params[f"{prefix}.experts.down_proj"][e].copy_(w)
            else:
                stacked = params[f"{prefix}.experts.gate_up_proj"][e]
                rows = w.shape[0]
                stacked[: rows if proj == "gate_proj" else None][-rows:].copy_(w)
        elif name in params:
            params[name].copy_(w.reshape(params[name].shape))
