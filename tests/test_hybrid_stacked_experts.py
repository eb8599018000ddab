"""MoE experts stored stacked (the Hub's Qwen3.5-MoE layout) load like per-expert ones.

transformers 5.24 keeps a MoE block's experts as `mlp.experts.gate_up_proj` [E, 2I, H]
(gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I], and the Hub's
Qwen3.5-MoE checkpoints store them so, main layers and MTP layer alike; its
`save_pretrained` writes one matrix per expert. A tiny random Qwen3.5-MoE with an MTP
layer is saved both ways (the stacked tensors written here with safetensors from the
per-expert ones), and transformers itself reads the stacked folder to the same logits,
so the layout written is transformers'. Ours must then give identical logits from both
layouts, within 1e-5 of transformers, for the model and its MTP drafter, from the folder
and from `.ninfer` conversions (quantized per expert), plan the same bytes, and refuse a
folder that stores an expert both ways or a malformed stack, naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from engine_helpers import prompt
from hybrid_helpers import load_fp32, new_sequence, reference_logits, runner_for
from safetensors.torch import load_file, save_file
from test_draft_mtp_hybrid import (
    TOL,
    draft_input,
    qwen3_5_moe_modules,
    random_mtp,
    target,
    target_hidden,
)
from test_draft_mtp_hybrid import reference_logits as mtp_reference_logits
from test_hybrid_qwen3_5 import write_tiny_qwen3_5

from ninfer_core.convert import convert
from ninfer_core.errors import ModelLoadError
from ninfer_core.eval_ppl import sequence_logits
from ninfer_core.loading import open_artifact
from ninfer_core.memory.planner import weights_bytes
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_core.spec.types import DraftOptions
from ninfer_plugins.draft_mtp import MTPStrategy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
LAYOUTS = ("per-expert", "stacked")


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every block's per-expert matrices replaced by transformers' two
    stacked ones: `experts.gate_up_proj` [E, 2I, H] = stack(cat(gate_e, up_e)) and
    `experts.down_proj` [E, H, I] = stack(down_e)."""
    out, blocks = {}, {}
    for name, value in tensors.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = value
            continue
        stem, e, proj = match.groups()
        blocks.setdefault(stem, {})[(int(e), proj)] = value
    for stem, parts in blocks.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{stem}.gate_up_proj"] = torch.stack(
            [torch.cat((parts[(e, "gate_proj")], parts[(e, "up_proj")])) for e in range(n)]
        )
        out[f"{stem}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    return out


def copy_text_files(source: Path, dest: Path) -> None:
    dest.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dest / name).write_bytes((source / name).read_bytes())


class Pair:
    """transformers' Qwen3.5-MoE and reference MTP layer, saved per expert (the MTP
    tensors beside `save_pretrained`'s) and stacked (written here)."""

    def __init__(self, root: Path) -> None:
        per_expert = root / "per-expert"
        per_expert.mkdir()
        self.reference = write_tiny_qwen3_5(per_expert, "moe", seed=7)
        self.mtp = random_mtp(self.reference.config, 41, qwen3_5_moe_modules())
        save_file(self.mtp.checkpoint(), str(per_expert / "mtp.safetensors"))
        tensors = {
            **load_file(str(per_expert / "model.safetensors")),
            **load_file(str(per_expert / "mtp.safetensors")),
        }
        stacked = root / "stacked"
        copy_text_files(per_expert, stacked)
        save_file(stack_experts(tensors), str(stacked / "model.safetensors"))
        self.paths = {"per-expert": per_expert, "stacked": stacked}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    return Pair(tmp_path_factory.mktemp("stacked-experts"))


def test_the_stacked_folder_holds_only_stacked_experts(pair):
    names = set(load_file(str(pair.paths["stacked"] / "model.safetensors")))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "mtp.layers.0.mlp.experts.down_proj" in names
    assert not any(EXPERT.fullmatch(n) for n in names)
    artifact = open_artifact(create_host(), pair.paths["stacked"])
    listed = set(artifact.tensor_names())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in listed
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in listed
    assert artifact.tensor_shape("model.layers.0.mlp.experts.3.up_proj.weight") == (32, 64)
    assert artifact.tensor_shape("mtp.layers.0.mlp.experts.1.down_proj.weight") == (64, 32)


@torch.no_grad()
def test_transformers_reads_the_stacked_folder_to_the_same_logits(pair):
    """The independent check on the layout written: transformers loads it directly."""
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(
        pair.paths["stacked"], dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager",
    ).eval()  # fmt: skip
    ids = prompt(24, seed=3)
    assert torch.equal(reference_logits(model, ids), reference_logits(pair.reference, ids))


def test_both_layouts_give_identical_logits_within_tol_of_transformers(pair):
    ids = prompt(40, seed=1)
    ref = reference_logits(pair.reference, ids)
    logits = {}
    for layout in LAYOUTS:
        hybrid = (pair.reference, *load_fp32(pair.paths[layout]))
        runner = runner_for(hybrid)
        logits[layout] = runner.run([(new_sequence(runner, ids), len(ids))], all_tokens=True)
    assert torch.equal(logits["per-expert"], logits["stacked"])
    assert (logits["stacked"] - ref).abs().max().item() <= TOL


def mtp_logits(path: Path, reference, ids: list[int]) -> torch.Tensor:
    loaded, host, _ = load_fp32(path)
    drafter = MTPStrategy().create(target(loaded, host), DraftOptions())
    assert type(drafter.layer.layer.mlp).__name__ == "SparseMoE"
    (out,) = drafter.catch_up([draft_input(ids, target_hidden(reference, ids))])
    return loaded.model.compute_logits(out)


def test_the_mtp_layer_loads_from_both_layouts(pair):
    ids = prompt(33, seed=2)
    ref = mtp_reference_logits(pair.reference, pair.mtp, ids)
    ours = {layout: mtp_logits(pair.paths[layout], pair.reference, ids) for layout in LAYOUTS}
    assert torch.equal(ours["per-expert"], ours["stacked"])
    assert (ours["stacked"] - ref).abs().max().item() <= TOL


def test_the_hub_multimodal_layout_with_stacked_experts_loads(pair, tmp_path):
    """`Qwen3_5MoeForConditionalGeneration`: the decoder under `model.language_model.`,
    experts stacked, the MTP layer at the top level (stacked too)."""
    source = pair.paths["stacked"]
    copy_text_files(source, tmp_path)
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False,
            "text_config": {k: v for k, v in config.items() if k != "architectures"},
            "vision_config": {"depth": 1, "hidden_size": 8},
        })
    )  # fmt: skip
    tensors = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
        for k, v in load_file(str(source / "model.safetensors")).items()
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ids = prompt(30, seed=4)
    hybrid = (pair.reference, *load_fp32(tmp_path))
    assert hybrid[1].model.hybrid.prefix == "model.language_model."
    runner = runner_for(hybrid)
    ours = runner.run([(new_sequence(runner, ids), len(ids))], all_tokens=True)
    ref = reference_logits(pair.reference, ids)
    assert (ours - ref).abs().max().item() <= TOL
    mtp_ids = prompt(21, seed=5)
    assert torch.equal(
        mtp_logits(tmp_path, pair.reference, mtp_ids),
        mtp_logits(pair.paths["per-expert"], pair.reference, mtp_ids),
    )


@pytest.mark.parametrize("recipe", ["bf16", "w8", "mixed"])
def test_conversions_of_both_layouts_are_the_same_file(pair, tmp_path, recipe):
    """`ninfer convert` reads the stacked folder as per-expert matrices: each expert is
    quantized by its role like any `gate_proj` / `down_proj`, and the two conversions
    load to identical model and MTP logits."""
    out = {}
    for layout in LAYOUTS:
        out[layout] = tmp_path / f"{layout}.ninfer"
        convert(pair.paths[layout], out[layout], recipe_name=recipe)
    loaded = {layout: load_fp32(out[layout])[0] for layout in LAYOUTS}
    names = {layout: set(loaded[layout].artifact.tensor_names()) for layout in LAYOUTS}
    assert names["per-expert"] == names["stacked"]
    expert = "model.layers.2.mlp.experts.3.down_proj.weight"
    weight = loaded["stacked"].artifact.load_weight(expert)
    assert isinstance(weight, QuantizedTensor) == (recipe != "bf16")
    ids = prompt(24, seed=6)
    assert torch.equal(*(sequence_logits(loaded[layout], ids) for layout in LAYOUTS))
    assert torch.equal(*(mtp_logits(out[layout], pair.reference, ids) for layout in LAYOUTS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_counts_both_layouts_alike(pair, dtype):
    host = create_host()
    planned = {}
    for layout in LAYOUTS:
        artifact = open_artifact(host, pair.paths[layout])
        family = host.family_for(artifact.config["architectures"][0])
        config = family.parse_config(artifact.config)
        planned[layout] = weights_bytes(config, dtype, artifact=artifact, family=family)
    assert planned["per-expert"] == planned["stacked"] > 0


def test_a_folder_storing_an_expert_both_ways_is_refused(pair, tmp_path):
    copy_text_files(pair.paths["stacked"], tmp_path)
    tensors = load_file(str(pair.paths["stacked"] / "model.safetensors"))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    extra = {"model.layers.1.mlp.experts.2.up_proj.weight": torch.zeros(32, 64)}
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.2\.up_proj\.weight.*also stored stacked"):
        open_artifact(create_host(), tmp_path)


@pytest.mark.parametrize(
    ("name", "shape", "reason"),
    [
        ("model.layers.0.mlp.experts.gate_up_proj", (4, 63, 64), "an even count"),
        ("model.layers.0.mlp.experts.down_proj", (4, 64), r"expected \[experts, rows, cols\]"),
        ("model.layers.0.mlp.experts.down_proj", (5000, 1, 1), "more than 4096"),
    ],
)
def test_a_malformed_stack_is_refused_naming_it(pair, tmp_path, name, shape, reason):
    copy_text_files(pair.paths["stacked"], tmp_path)
    save_file({name: torch.zeros(shape)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=re.escape(name) + ".*" + reason):
        open_artifact(create_host(), tmp_path)


def test_an_artifact_listing_stacked_experts_is_refused_by_name(pair):
    """Only a folder is read per expert; another artifact that lists stacked tensors (a
    `.ninfer` converted before the folder reader split them) is refused naming one."""
    folder = open_artifact(create_host(), pair.paths["per-expert"])
    family = create_host().family_for(folder.config["architectures"][0])
    config = family.parse_config(folder.config)

    class Stacked:
        path = Path("old.ninfer")

        def tensor_names(self) -> list[str]:
            return ["model.layers.0.mlp.experts.gate_up_proj", *folder.tensor_names()]

    with pytest.raises(ModelLoadError, match=r"old\.ninfer: MoE experts stored stacked .*"
                       r"experts\.gate_up_proj.*convert the folder again"):  # fmt: skip
        family.check_artifact(config, Stacked())
