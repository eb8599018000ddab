"""`ninfer convert` and `ninfer inspect`: HF folder → .ninfer → the same model, on real output."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import prompt_logits, write_tiny_qwen3
from text_fixtures import write_model_dir

from ninfer_core.artifact.reader import open_container
from ninfer_core.artifact.writer import ContainerWriter
from ninfer_core.bench.agreement import logit_agreement
from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import component_of, convert
from ninfer_core.device import probe_device
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.formats import weight_format

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: recipe -> (logits relative RMS error, top-1 agreement) bounds against the HF folder's
#: logits, fp32 compute, over PROMPTS on this 3-layer random-weight checkpoint; measured
#: (worst prompt) w8 0.027 / 0.96, q6 0.12 / 0.75, mixed 0.43 / 0.46, q4 0.50 / 0.25. A
#: random network passes weight noise on almost undamped (about sqrt(21 matrices) x the
#: per-weight error), so these are loose; docs/quantization.md has the 0.6B figures.
RECIPE_BOUNDS = {"w8": (0.04, 0.9), "q6": (0.16, 0.6), "mixed": (0.6, 0.3), "q4": (0.7, 0.15)}
PROMPTS = [torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(s)).tolist()
           for s in range(3)]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny bf16 Qwen3 with a tokenizer and chat template, as people download them."""
    path = write_tiny_qwen3(tmp_path_factory.mktemp("hf") / "tiny", dtype=torch.bfloat16)
    write_model_dir(path)
    return path


def _load(path):
    return load_model(
        path, host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype="fp32"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(folder):
    loaded = _load(folder)
    return [prompt_logits(loaded, ids) for ids in PROMPTS]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_bf16_recipe_gives_the_folder_logits_exactly(folder, reference, tmp_path, version):
    out = tmp_path / "m.ninfer"
    convert(folder, out, recipe_name="bf16", version=version)
    loaded = _load(out)
    assert loaded.artifact.version == version
    for ids, ref in zip(PROMPTS, reference, strict=True):
        assert torch.equal(prompt_logits(loaded, ids), ref)


@pytest.mark.parametrize("name", sorted(RECIPE_BOUNDS))
def test_quantized_recipes_stay_within_their_bound(folder, reference, tmp_path, name):
    out = tmp_path / f"{name}.ninfer"
    summary = convert(folder, out, recipe_name=name)
    loaded = _load(out)
    pairs = zip(PROMPTS, reference, strict=True)
    rows = [logit_agreement(prompt_logits(loaded, ids), ref) for ids, ref in pairs]
    errs, agree = [r.rel_rms for r in rows], [r.top1 for r in rows]
    max_err, min_agree = RECIPE_BOUNDS[name]
    assert max(errs) < max_err, errs
    assert min(errs) > 0  # the weights really are quantized
    assert min(agree) >= min_agree, agree
    # fewer bits than bf16's 16, and the stored bytes are what the formats say
    assert summary.bits_per_weight < 16
    with open_container(out) as art:
        for rec in art.object_table():
            if rec.kind == "tensor":
                assert rec.nbytes == weight_format(rec.format).stored_nbytes(rec.shape)


def test_recipe_mixed_puts_each_role_in_its_format(folder, tmp_path):
    out = tmp_path / "m.ninfer"
    convert(folder, out, recipe_name="mixed")
    with open_container(out) as art:
        fmt = art.tensor_format
        assert fmt("model.embed_tokens.weight") == "Q6G64"
        assert fmt("model.layers.0.self_attn.q_proj.weight") == "Q4G64"
        assert fmt("model.layers.0.mlp.up_proj.weight") == "Q4G64"
        assert fmt("model.layers.0.self_attn.o_proj.weight") == "Q5G64"
        assert fmt("model.layers.0.mlp.down_proj.weight") == "Q5G64"
        assert not weight_format(fmt("model.layers.0.input_layernorm.weight")).quantized
        assert art.identity["model_id"] == folder.name
        assert art.identity["weights_id"].startswith("sha256:")
        assert art.recipe["name"] == "mixed"
        for res in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert art.read_text(res) == (folder / res).read_text(encoding="utf-8")


def test_weights_id_names_the_weights_not_the_recipe(folder, tmp_path):
    ids = set()
    for name in ("bf16", "q4"):
        convert(folder, tmp_path / f"{name}.ninfer", recipe_name=name)
        with open_container(tmp_path / f"{name}.ninfer") as art:
            ids.add(art.identity["weights_id"])
    assert len(ids) == 1


def test_volumes_split_and_load(folder, reference, tmp_path):
    out = tmp_path / "m.ninfer"
    summary = convert(folder, out, recipe_name="bf16", volume_limit=40_000)
    assert summary.volumes > 2
    assert len(list(tmp_path.glob("m.ninfer.part-*"))) == summary.volumes - 1
    assert torch.equal(prompt_logits(_load(out), PROMPTS[0]), reference[0])


def test_components_by_tensor_name():
    assert component_of("model.layers.0.mlp.up_proj.weight") == "text"
    assert component_of("mtp.layers.0.mlp.up_proj.weight") == "mtp"
    assert component_of("model.mtp_block.fc.weight") == "mtp"
    assert component_of("visual.blocks.0.attn.qkv.weight") == "vision"


def test_convert_cli_prints_a_summary(folder, tmp_path, capsys):
    out = tmp_path / "m.ninfer"
    assert main(["convert", str(folder), str(out), "--recipe", "q4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    with open_container(out) as art:
        tensors = [r for r in art.object_table() if r.kind == "tensor"]
    assert summary["tensors"] == len(tensors)
    assert summary["tensor_bytes"] == sum(r.nbytes for r in tensors)
    assert summary["by_format"]["Q4G64"]["tensors"] == 22  # 7 matrices x 3 layers + embedding
    assert 4 < summary["bits_per_weight"] < 5  # 4 bits + one fp16 scale per 64, norms fp32


def test_convert_cli_errors(folder, tmp_path, capsys):
    assert main(["convert", str(folder), str(tmp_path / "m.ninfer"), "--recipe", "q3"]) == 1
    err = capsys.readouterr().err
    assert "unknown quantization recipe 'q3'" in err and "mixed" in err
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "m.ninfer")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "m.ninfer").exists()


def test_inspect_prints_the_table(folder, tmp_path, capsys):
    out = tmp_path / "m.ninfer"
    convert(folder, out, recipe_name="mixed", model_id="tiny-test")
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == f"{out}: .ninfer container v3"
    assert any(ln.startswith("identity     model_id=tiny-test  weights_id=sha256:") for ln in lines)
    assert "recipe       mixed" in lines
    with open_container(out) as art:
        for rec in art.object_table():
            if rec.kind != "tensor":
                continue
            row = next(ln for ln in lines if ln.split()[:1] == [rec.name])
            shape = "x".join(str(d) for d in rec.shape)
            assert row.split() == [rec.name, rec.format, shape, f"{rec.nbytes:,}", "text"]
        resources = [r for r in art.object_table() if r.kind == "resource"]
    for rec in resources:
        assert any(ln.split() == [rec.name, f"{rec.nbytes:,}"] for ln in lines)
    assert lines[-1].startswith("totals       35 tensors, ")


def test_inspect_verify_finds_a_flipped_byte(folder, tmp_path, capsys):
    out = tmp_path / "m.ninfer"
    convert(folder, out, recipe_name="q4")
    assert main(["inspect", str(out), "--verify"]) == 0
    assert "verify: ok" in capsys.readouterr().out
    with open_container(out) as art:
        rec = next(r for r in art.object_table() if r.name == "model.layers.1.mlp.up_proj.weight")
        start = out.stat().st_size - art.header.volume_end(0)  # the payload's start
    data = bytearray(out.read_bytes())
    data[start + rec.offset + 5] ^= 0x10
    out.write_bytes(bytes(data))
    assert main(["inspect", str(out), "--verify", "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert not info["verify"]["ok"]
    assert any(rec.name in p for p in info["verify"]["problems"])


def test_inspect_refuses_what_is_not_a_container(tmp_path, capsys):
    bad = tmp_path / "x.ninfer"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    assert main(["inspect", str(bad)]) == 1
    assert "not a .ninfer file" in capsys.readouterr().err


def test_inspect_refuses_a_name_with_a_lone_surrogate(tmp_path, capsys):
    # JSON's "\ud800" decodes to a str that cannot be written as UTF-8: printing it crashed.
    from test_artifact_fuzz import make, rewrite

    path = make(tmp_path)

    def rename(header):
        header["objects"][1]["name"] = "a\ud800b"

    rewrite(path, rename)
    assert main(["inspect", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "lone surrogate" in err and r"a\ud800b" in err
    writer = ContainerWriter(tmp_path / "w.ninfer", version=3)
    with pytest.raises(ValueError, match="lone surrogate"), writer as w:
        w.add_tensor("x\udc80", "fp32", (1,), torch.zeros(1))


def test_convert_refuses_a_ninfer_file_as_its_source(tmp_path):
    """A .ninfer file (here the built-in model, mixed recipe) is not a folder of source
    weights: converting it again would read packed codes as weights."""
    from ninfer_core.builtin_model import default_model
    from ninfer_core.convert import convert
    from ninfer_core.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="convert reads Hugging Face model folders"):
        convert(default_model(), tmp_path / "again.ninfer", recipe_name="bf16")
