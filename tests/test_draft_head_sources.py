"""`ninfer draft-head build` from a Hugging Face folder and from a GGUF file.

Both are the built-in model (its MTP layer included) written out again: a folder of
dequantized fp32 safetensors, and a qwen3 GGUF (embedding/head in Q8_0, the rest F32,
the MTP tensors under their own names). Each build's output must load with `--spec mtp
--lm-head-draft` and decode greedily exactly as the same model without speculation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer_core.artifact.reader import open_container, read_header
from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.draft_head_build import build_draft_head, default_out
from ninfer_core.draft_head_folder import HEAD_FILE, INDEX_NAME
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_core.sampling import SamplingParams
from ninfer_core.spec.config import SpecConfig
from ninfer_core.spec.draft_head import COMPONENT, TOKEN_IDS, WEIGHT, ReducedHead, has_draft_head
from ninfer_core.text import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROWS = 256
FP32 = RuntimeConfig(dtype="fp32")
RESOURCES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
CODE = '''import os


def walk_sizes(root):
    """Yield (path, size) for every file under root."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
'''


def builtin_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of the built-in model, MTP layer included, dequantized to fp32."""
    header, _ = read_header(BUILTIN_ARTIFACT)
    with open_container(BUILTIN_ARTIFACT, components=header.components) as src:
        out = {}
        for name in src.tensor_names():
            w = src.load_weight(name)
            out[name] = w.dequantize(torch.float32) if isinstance(w, QuantizedTensor) else w
        return out


def resources() -> dict[str, str]:
    with open_container(BUILTIN_ARTIFACT) as src:
        return {name: src.read_resource(name).decode() for name in RESOURCES}


def write_folder(path: Path, shards: int = 1) -> Path:
    """The built-in model as a Hugging Face folder; with `shards` > 1, split with an index."""
    path.mkdir()
    for name, text in resources().items():
        (path / name).write_text(text, encoding="utf-8")
    tensors = builtin_tensors()
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index), encoding="utf-8")
    return path


def write_gguf(path: Path) -> Path:
    """The built-in model as a qwen3 GGUF (tied embedding in Q8_0, the rest F32)."""
    import gguf

    from ninfer_core.bench.gguf_write import (
        add_hparams,
        add_tensor,
        add_vocab,
        add_weights,
        bpe_vocab,
        write_file,
    )

    q = gguf.GGMLQuantizationType
    texts = resources()
    config = json.loads(texts["config.json"])
    tokenizer = json.loads(texts["tokenizer.json"])
    w = gguf.GGUFWriter(str(path), "qwen3")
    add_hparams(w, config)
    template = json.loads(texts["tokenizer_config.json"])["chat_template"]
    vocab = bpe_vocab(tokenizer, config["vocab_size"])
    add_vocab(w, vocab, pre="gpt2", bos=None, eos=2, pad=0, template=template)
    tensors = {n: t.numpy() for n, t in builtin_tensors().items()}
    model = [(n, a) for n, a in tensors.items() if not n.startswith("mtp.")]
    add_weights(w, "qwen3", config, model, matrices=q.F32,
                types={"token_embd.weight": q.Q8_0})  # fmt: skip
    for name, a in tensors.items():
        if name.startswith("mtp."):  # no llama.cpp name: the reader serves it as it is
            add_tensor(w, name, a, q.F32)
    write_file(w)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "code.py").write_text(CODE * 3, encoding="utf-8")
    (root / "more.py").write_text(CODE.replace("size", "length") * 2, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        "folder": write_folder(root / "hf"),
        "sharded": write_folder(root / "sharded", shards=2),
        "gguf": write_gguf(root / "builtin.gguf"),
    }


def greedy(loaded, prompts: list[list[int]], spec: SpecConfig | None) -> tuple[list, Engine]:
    host, device = create_host(), probe_device(use_cuda=False)
    engine = Engine(loaded, EngineConfig(kv_capacity=2048, max_concurrency=4), host=host,
                    device=device, kv_dtype="fp32", spec=spec, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0)
    requests = [GenerationRequest(ids, params, max_tokens=32, ignore_eos=True) for ids in prompts]
    return [r.token_ids for r in engine.generate(requests)], engine


def load(path: Path):
    return load_model(path, host=create_host(), device=probe_device(use_cuda=False), runtime=FP32)


@pytest.mark.parametrize("kind", ["folder", "sharded", "gguf"])
def test_each_kind_builds_and_drafts_losslessly_through_its_head(kind, sources, corpus, tmp_path):
    source = sources[kind]
    report = build_draft_head(source, corpus, ROWS, out=tmp_path / "out", heldout_fraction=0.0,
                              runtime=FP32)  # fmt: skip
    assert report.path == tmp_path / "out" and report.source == source
    assert report.rows == ROWS and report.ranking.tokens > 0
    loaded = load(report.path)
    assert has_draft_head(loaded.artifact)
    head = ReducedHead.from_artifact(loaded.artifact, loaded.model)
    assert head.token_ids.tolist() == report.token_ids
    tokenizer = Tokenizer.from_artifact(loaded.artifact)
    prompts = [tokenizer.encode(CODE, add_special_tokens=False)[:40]]
    want, _ = greedy(load(source), prompts, None)
    got, engine = greedy(
        loaded, prompts, SpecConfig(spec="mtp", draft_tokens=3, lm_head_draft=True)
    )
    assert isinstance(engine.drafter.head, ReducedHead) and engine.drafter.head.rows == ROWS
    assert got == want
    assert engine.spec_counters.accepted > 0


def test_a_folder_output_is_the_source_plus_the_head_file(sources, corpus, tmp_path):
    source = sources["folder"]
    report = build_draft_head(source, corpus, 64, out=tmp_path / "hf.draft-head",
                              heldout_fraction=0.0, max_tokens=200, runtime=FP32)  # fmt: skip
    out = report.path
    assert sorted(p.name for p in out.iterdir()) == sorted([*RESOURCES, "model.safetensors",
                                                           HEAD_FILE])  # fmt: skip
    for f in source.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes()
    weights, config = source / "model.safetensors", source / "config.json"
    assert os.path.samefile(out / weights.name, weights)  # the weights are linked
    assert not os.path.samefile(out / config.name, config)  # small files are copied
    head = load_file(str(out / HEAD_FILE))
    assert set(head) == {WEIGHT, TOKEN_IDS} and head[TOKEN_IDS].dtype == torch.float32
    assert head[TOKEN_IDS].tolist() == [float(i) for i in report.token_ids]
    embed = load_file(str(weights))["model.embed_tokens.weight"]  # the head is tied
    assert torch.equal(head[WEIGHT], embed[torch.tensor(report.token_ids)])
    # a rebuild from the output replaces its head
    again = build_draft_head(out, corpus, 32, heldout_fraction=0.0, max_tokens=100,
                             runtime=FP32)  # fmt: skip
    assert again.path == default_out(out) == out.with_name("hf.draft-head.draft-head")
    assert load_file(str(again.path / HEAD_FILE))[WEIGHT].shape == (32, 256)


def test_a_sharded_folders_index_names_the_head_file(sources, corpus, tmp_path):
    report = build_draft_head(sources["sharded"], corpus, 64, out=tmp_path / "o",
                              heldout_fraction=0.0, max_tokens=100, runtime=FP32)  # fmt: skip
    index = json.loads((report.path / INDEX_NAME).read_text())
    old = json.loads((sources["sharded"] / INDEX_NAME).read_text())
    assert index["weight_map"] == {**old["weight_map"], WEIGHT: HEAD_FILE, TOKEN_IDS: HEAD_FILE}
    assert index["metadata"]["total_size"] == 1 + 64 * 256 * 4 + 64 * 4


def test_a_gguf_output_is_its_conversion_with_the_head(sources, corpus, tmp_path):
    source = sources["gguf"]
    report = build_draft_head(source, corpus, 64, heldout_fraction=0.0, max_tokens=100,
                              runtime=FP32)  # fmt: skip
    assert report.path == source.with_name("builtin.draft-head.ninfer") == default_out(source)
    assert sorted(p.name for p in source.parent.iterdir()) == sorted(
        ["hf", "sharded", "builtin.gguf", "builtin.draft-head.ninfer"]
    )  # the conversion it ran from is gone
    header, _ = read_header(report.path)
    assert set(header.components) == {"text", "mtp", COMPONENT}
    formats = {o.name: o.format for o in header.objects}
    assert formats["model.embed_tokens.weight"] == formats[WEIGHT] == "W8G32"  # Q8_0's codes
    assert report.seconds["convert"] > 0
    report.path.unlink()


@pytest.mark.parametrize(
    ("kind", "out", "problem"),
    [
        ("folder", "taken", "taken: exists; the output is a new folder"),
        ("folder", "hf/inside", "would be inside the input folder"),
        ("gguf", "copy.gguf", "copy.gguf: the output is a .ninfer file"),
    ],
)
def test_an_output_it_cannot_write_fails_in_one_line(kind, out, problem, sources, corpus, capsys):
    from ninfer_core.cli.main import main

    root = sources["folder"].parent
    (root / "taken").mkdir(exist_ok=True)
    (root / "taken" / "mine.txt").write_text("someone's")
    args = ["draft-head", "build", str(sources[kind]), "--corpus", str(corpus), "--rows", "16",
            "--out", str(root / out), "--no-progress"]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer draft-head: error: ") and err.count("\n") == 1
    assert problem in err, err
    assert not (root / "hf" / "inside").exists() and not (root / "copy.gguf").exists()
