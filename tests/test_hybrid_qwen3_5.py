"""The `qwen3.5` family (ninfer_plugins/model_hybrid) against transformers' Qwen3.5.

Tiny random `Qwen3_5ForCausalLM` (dense MLPs) and `Qwen3_5MoeForCausalLM` (4 experts,
top-2, a shared expert on every layer): 3 Gated DeltaNet layers + 1 gated full-attention
layer, Hv = 2 x Hqk, partial M-RoPE (plain RoPE for text). transformers builds them from a
seed, its constant-initialised weights are perturbed (`save_perturbed`), and
`save_pretrained` writes the text-only naming (`model.layers...`, flat `in_proj_qkv` /
`_z` / `_b` / `_a`). Our loader, runner and engine must give its logits and greedy tokens.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from engine_helpers import prompt
from hybrid_helpers import (
    LAYER_TYPES,
    TOL,
    check_chunked_prefill_then_decode,
    check_greedy_generation,
    check_one_shot_prefill,
    load_fp32,
    new_sequence,
    reference_logits,
    runner_for,
    save_perturbed,
)
from safetensors.torch import load_file, save_file

from ninfer_core.errors import ModelLoadError
from ninfer_core.model.caches import PagedKV, caches_for
from ninfer_core.model.moe import SparseMoE, SwiGLU
from ninfer_plugins.model_hybrid import HybridDecoder, Qwen3_5Family
from ninfer_plugins.model_hybrid.model import planned_weights, weight_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        # As the Hub's configs: text positions are equal on all three axes, so these
        # change nothing for text; transformers still takes its M-RoPE path.
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    # Wider than 0.02 so logits are peaked and greedy output varies.
    initializer_range=0.1,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)  # fmt: skip


def write_tiny_qwen3_5(path, variant: str, seed: int = 0) -> torch.nn.Module:
    """Save a seeded random Qwen3.5 text model, `variant` "dense" or "moe", to `path`;
    return it in eval mode."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    if variant == "dense":
        config = Qwen3_5TextConfig(**COMMON, intermediate_size=96)
        cls = Qwen3_5ForCausalLM
    else:
        config = Qwen3_5MoeTextConfig(**COMMON, **MOE)
        config._experts_implementation = "eager"
        cls = Qwen3_5MoeForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    save_perturbed(model, path, seed)
    return model


@pytest.fixture(scope="module", params=["dense", "moe"])
def hybrid(request, tmp_path_factory):
    """(reference, loaded, host, device) for each variant, both fp32."""
    path = tmp_path_factory.mktemp(f"qwen3_5-{request.param}")
    reference = write_tiny_qwen3_5(path, request.param)
    return (reference, *load_fp32(path))


def test_the_family_loads_the_text_checkpoint(hybrid):
    reference, loaded, _, _ = hybrid
    assert loaded.family.name == "qwen3.5" and isinstance(loaded.model, HybridDecoder)
    assert not loaded.model.hybrid.grouped_projections
    caches = caches_for(loaded.family, loaded.config)
    assert caches.paged_layers == [2] and sorted(caches.state_layers) == [0, 1, 3]
    assert caches.layers[2] == PagedKV(2, 16)
    moe = hasattr(reference.config, "num_experts")
    kind = SparseMoE if moe else SwiGLU
    assert all(isinstance(layer.mlp, kind) for layer in loaded.model.layers)


def test_the_planned_weight_count_is_the_plans(hybrid):
    config = hybrid[1].model.hybrid
    plan = weight_plan(config)
    assert planned_weights(config) == sum(math.prod(s.shape) for s in plan)
    names = {s.hf_name for s in plan}
    assert "model.layers.0.linear_attn.in_proj_z.weight" in names
    assert set(load_file(str(hybrid[1].path / "model.safetensors"))) == names


def test_one_shot_prefill_matches_transformers(hybrid):
    check_one_shot_prefill(hybrid)


def test_uneven_chunked_prefill_then_decode_matches_transformers(hybrid):
    check_chunked_prefill_then_decode(hybrid)


def test_greedy_generation_matches_transformers_generate(hybrid):
    check_greedy_generation(hybrid, 24)


def test_a_multimodal_checkpoint_loads_as_its_text_model(hybrid, tmp_path):
    """The Hub's layout: `Qwen3_5...ForConditionalGeneration`, the text fields under
    `text_config`, the decoder under `model.language_model.`, a vision tower beside it
    (not read). It loads as the text model and gives the same logits."""
    reference, loaded, _, _ = hybrid
    source = loaded.path
    config = json.loads((source / "config.json").read_text())
    moe = "num_experts" in config
    nested = {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {k: v for k, v in config.items() if k != "architectures"},
        "vision_config": {"depth": 1, "hidden_size": 8},
    }
    (tmp_path / "config.json").write_text(json.dumps(nested))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    tensors = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
        for k, v in load_file(str(source / "model.safetensors")).items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    multimodal = (reference, *load_fp32(tmp_path))
    assert multimodal[1].family.name == "qwen3.5"
    assert multimodal[1].model.hybrid.prefix == "model.language_model."
    ids = prompt(30, seed=4)
    runner = runner_for(multimodal)
    ours = runner.run([(new_sequence(runner, ids), len(ids))], all_tokens=True)
    assert (ours - reference_logits(reference, ids)).abs().max().item() <= TOL


def test_a_text_config_that_is_not_an_object_is_named():
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": 3}
    with pytest.raises(ModelLoadError, match="text_config"):
        Qwen3_5Family().parse_config(raw)
