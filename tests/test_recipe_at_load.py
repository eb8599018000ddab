"""`--recipe NAME` quantizes a checkpoint's dense matrices while it loads, as `ninfer
convert --recipe NAME` would have stored them (`ninfer_core/quant/at_load.py`)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import write_tiny_qwen3

from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import convert
from ninfer_core.device import probe_device
from ninfer_core.eval_ppl import sequence_logits
from ninfer_core.loading import load_model, open_artifact
from ninfer_core.memory.planner import weights_bytes
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.at_load import QuantizingArtifact, quantizes, with_recipe
from ninfer_core.quant.recipes import recipe
from ninfer_core.quant.tensor import QuantizedTensor

IDS = [3, 17, 90, 4, 250, 8, 61, 299, 12, 5]  # vocabulary 300


@pytest.fixture(scope="module")
def host():
    return create_host()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_qwen3(
        tmp_path_factory.mktemp("tiny"), head_dim=64, hidden_size=256, intermediate_size=512,
        tie_word_embeddings=False,
    )  # fmt: skip


def _load(path, host, **runtime):
    return load_model(path, host=host, device=probe_device(use_cuda=False),
                      runtime=RuntimeConfig(dtype="fp32", **runtime))  # fmt: skip


@pytest.mark.parametrize("name", ["mixed", "q4"])
def test_a_folder_quantized_while_loading_is_the_converted_file(folder, host, tmp_path, name):
    """The same codes, so the same logits bit for bit, and the bytes the plan counts."""
    converted = tmp_path / "m.ninfer"
    convert(folder, converted, recipe_name=name)
    at_load = _load(folder, host, recipe=name)
    from_file = _load(converted, host)
    assert torch.equal(sequence_logits(at_load, IDS), sequence_logits(from_file, IDS))
    plain = sequence_logits(_load(folder, host), IDS)
    assert not torch.equal(sequence_logits(at_load, IDS), plain)  # it did quantize

    def planned(loaded) -> int:
        return weights_bytes(
            loaded.config, torch.float32, artifact=loaded.artifact, family=loaded.family
        )

    assert planned(at_load) == planned(from_file) < planned(_load(folder, host))


def test_formats_are_the_recipes_for_dense_matrices_only(folder, host):
    source = open_artifact(host, folder)
    view = QuantizingArtifact(source, recipe("mixed"))
    assert view.tensor_format("model.layers.0.self_attn.q_proj.weight") == "Q4G64"
    assert view.tensor_format("model.layers.0.mlp.down_proj.weight") == "Q5G64"
    assert view.tensor_format("lm_head.weight") == "Q6G64"
    assert view.tensor_format("model.layers.0.input_layernorm.weight") == ""  # 1-D: as stored
    weight = view.load_weight("model.layers.0.self_attn.q_proj.weight")
    assert isinstance(weight, QuantizedTensor) and weight.fmt.name == "Q4G64"
    dense = source.load_tensor("model.layers.0.self_attn.q_proj.weight")
    # each value within half a step of its group's scale (symmetric 4-bit codes)
    step = weight.scales.float().repeat_interleave(64, dim=1)[:, : dense.shape[1]]
    assert bool(((weight.dequantize() - dense).abs() <= step / 2 + 1e-6).all())
    assert quantizes(source, recipe("q4")) and not quantizes(source, recipe("bf16"))
    assert with_recipe(source, "auto") is source and with_recipe(source, "none") is source


def test_an_already_quantized_source_keeps_its_codes(folder, host, tmp_path):
    converted = tmp_path / "w8.ninfer"
    convert(folder, converted, recipe_name="w8")
    source = open_artifact(host, converted)
    view = QuantizingArtifact(source, recipe("q4"))
    name = "model.layers.0.mlp.gate_proj.weight"
    assert view.tensor_format(name) == "W8G32"
    assert torch.equal(view.load_weight(name).packed, source.load_weight(name).packed)
