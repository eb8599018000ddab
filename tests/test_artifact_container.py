"""The `.ninfer` container: writer and reader round trips (v1, v2, v3), volumes, components,
the reader plugin, and a real model served from one file with logits equal to the folder's."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from checkpoints import prompt_logits, write_tiny_qwen3
from text_fixtures import write_model_dir

from ninfer_core.artifact.layout import MAGIC, OBJECT_ALIGN, PAYLOAD_ALIGN
from ninfer_core.artifact.reader import NinferArtifact, open_container
from ninfer_core.artifact.writer import ContainerWriter
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.errors import ArtifactError
from ninfer_core.loading import load_model, open_artifact
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.formats import FORMATS
from ninfer_plugins.artifact_ninfer import NinferContainerReader, register_artifact_readers
from ninfer_plugins.artifact_safetensors import open_hf_folder

IDENTITY = {"model_id": "tiny/qwen3", "weights_id": "sha256:0123"}
RECIPE = {"name": "mixed", "formats": {"q4": "Q4G64", "w8": "W8G32"}}
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64}
RESOURCES = {
    "config.json": json.dumps(CONFIG),
    "tokenizer.json": '{"model": {"type": "BPE"}, "note": "café ✓"}',
    "chat_template.jinja": "{{ messages }}",
    "empty.txt": "",
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample_tensors() -> dict[str, tuple[str, tuple[int, ...], torch.Tensor]]:
    """name -> (format, shape, data): dense tensors and raw bytes for every quantized format."""
    g = _gen(0)
    out: dict[str, tuple[str, tuple[int, ...], torch.Tensor]] = {
        "bf16": ("bf16", (5, 7), torch.randn(5, 7, generator=g).bfloat16()),
        "fp16": ("fp16", (3, 2, 4), torch.randn(3, 2, 4, generator=g).half()),
        "fp32": ("fp32", (33,), torch.randn(33, generator=g)),
        "scalar": ("fp32", (), torch.tensor(2.5)),
        "empty": ("bf16", (0, 4), torch.zeros(0, 4, dtype=torch.bfloat16)),
    }
    for i, fmt in enumerate(("Q4G64", "Q5G64", "Q6G64", "W8G32")):
        shape = (3, 100)  # 100 columns: the last group is padded
        n = FORMATS[fmt].stored_nbytes(shape)
        out[fmt.lower()] = (fmt, shape, torch.randint(0, 256, (n,), generator=_gen(i + 1)).byte())
    return out


def stored_bytes(data: torch.Tensor) -> bytes:
    return data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_sample(path: Path, version: int, **kwargs) -> dict:
    tensors = sample_tensors()
    if version >= 2:
        kwargs.setdefault("identity", IDENTITY)
        kwargs.setdefault("recipe", RECIPE)
    with ContainerWriter(path, version=version, **kwargs) as w:
        for name, text in RESOURCES.items():
            w.add_resource(name, text)
        for name, (fmt, shape, data) in tensors.items():
            w.add_tensor(name, fmt, shape, data)
    return tensors


def check_contents(art: NinferArtifact, tensors: dict) -> None:
    assert art.tensor_names() == list(tensors)
    for name, (fmt, shape, data) in tensors.items():
        assert art.tensor_shape(name) == shape
        assert art.tensor_format(name) == fmt
        raw = art.load_raw(name)
        assert raw.dtype == torch.uint8 and raw.dim() == 1
        assert raw.numpy().tobytes() == stored_bytes(data)
        if not FORMATS[fmt].quantized:
            got = art.load_tensor(name)
            assert got.dtype == data.dtype and tuple(got.shape) == shape
            assert torch.equal(got, data)
    for name, text in RESOURCES.items():
        assert art.read_text(name) == text
        assert art.read_resource(name) == text.encode()
    assert art.read_text("generation_config.json") is None
    assert art.config == CONFIG
    assert art.verify() == []


@pytest.mark.parametrize("version", [1, 2, 3])
def test_round_trip(tmp_path, version):
    path = tmp_path / "m.ninfer"
    aid = bytes(range(16))
    tensors = write_sample(path, version, **({"artifact_id": aid} if version == 3 else {}))
    data = path.read_bytes()
    assert data[:7] == MAGIC and data[7] == version
    with open_container(path) as art:
        assert art.version == version
        check_contents(art, tensors)
        assert art.identity == (IDENTITY if version >= 2 else None)
        assert art.recipe == (RECIPE if version >= 2 else None)
        assert art.artifact_id == (aid if version == 3 else None)
        assert list(art.components) == ["text"]
        table = art.object_table()
        assert [r.name for r in table] == [*RESOURCES, *tensors]
        assert all(r.offset % OBJECT_ALIGN == 0 and r.volume == 0 for r in table)
        assert art.tensor_file("bf16") == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ninfer"]  # no temporaries left


def test_payload_is_aligned_and_the_file_ends_at_the_last_object(tmp_path):
    path = tmp_path / "m.ninfer"
    write_sample(path, 3)
    with open_container(path) as art:
        last = art.object_table()[-1]
        payload_start = path.stat().st_size - last.end
    assert payload_start % PAYLOAD_ALIGN == 0


def test_three_volumes_and_components(tmp_path):
    path = tmp_path / "big.ninfer"
    g = _gen(7)
    tensors = {f"w{i}": torch.randn(32, 32, generator=g) for i in range(5)}  # 4 KiB each
    mtp = torch.randn(16, generator=g).half()
    with ContainerWriter(path, volume_limit=9000, components={"mtp": "the MTP layer"}) as w:
        w.add_resource("config.json", json.dumps(CONFIG))
        for name, t in tensors.items():
            w.add_tensor(name, "fp32", t.shape, t)
        w.add_tensor("mtp.fc", "fp16", (16,), mtp, component="mtp")
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert parts == ["big.ninfer", "big.ninfer.part-0001", "big.ninfer.part-0002"]

    art = open_container(path)
    assert art.components == {"text": "the language model", "mtp": "the MTP layer"}
    assert art.enabled == {"text"}
    assert art.tensor_names() == list(tensors)  # mtp is off by default
    assert sorted({r.volume for r in art.object_table()}) == [0, 1, 2]
    for name, t in tensors.items():
        assert torch.equal(art.load_tensor(name), t)
    assert art.tensor_file("w4").name.startswith("big.ninfer.part-")
    with pytest.raises(ArtifactError, match="component 'mtp', which is not enabled"):
        art.load_tensor("mtp.fc")
    assert art.verify() == []  # verify covers every component

    both = open_container(path, components={"text", "mtp"})
    assert both.tensor_names() == [*tensors, "mtp.fc"]
    assert torch.equal(both.load_tensor("mtp.fc"), mtp)
    with pytest.raises(ArtifactError, match="no component 'vision' in this file; it has: text"):
        open_container(path, components={"vision"})


def test_an_object_larger_than_the_volume_limit_gets_a_volume_of_its_own(tmp_path):
    path = tmp_path / "m.ninfer"
    with ContainerWriter(path, volume_limit=1000) as w:
        w.add_tensor("a", "fp32", (10,), torch.ones(10))
        w.add_tensor("big", "fp32", (1000,), torch.ones(1000))
        w.add_tensor("b", "fp32", (10,), torch.ones(10))
        w.add_tensor("c", "fp32", (10,), torch.ones(10))
    vols = {r.name: r.volume for r in open_container(path).object_table()}
    assert vols == {"a": 0, "big": 1, "b": 2, "c": 2}


def test_open_artifact_picks_the_container_reader(tmp_path):
    path = tmp_path / "m.ninfer"
    tensors = write_sample(path, 3)
    host = create_host()
    assert "ninfer-container" in host.artifact_readers.names()
    art = open_artifact(host, path)
    assert isinstance(art, NinferArtifact)
    check_contents(art, tensors)
    # A container under another name is still recognised by its magic.
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(path.read_bytes())
    assert isinstance(open_artifact(host, renamed), NinferArtifact)


def test_reader_plugin(tmp_path):
    (reader,) = register_artifact_readers()
    assert isinstance(reader, NinferContainerReader) and reader.name == "ninfer-container"
    assert reader.supports(probe_device(use_cuda=False))
    (tmp_path / "x.ninfer").write_bytes(b"junk")  # claimed by suffix, then refused clearly
    assert reader.can_read(tmp_path / "x.ninfer")
    with pytest.raises(ArtifactError, match=r"not a \.ninfer file"):
        reader.open(tmp_path / "x.ninfer")
    (tmp_path / "other.bin").write_bytes(b"PK\x03\x04....")
    assert not reader.can_read(tmp_path / "other.bin")
    assert not reader.can_read(tmp_path)  # a folder is the HF reader's


def test_views_are_writable_and_never_change_the_file(tmp_path):
    path = tmp_path / "m.ninfer"
    write_sample(path, 3)
    before = path.read_bytes()
    art = open_container(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = art.load_tensor("fp32")
    t.add_(1.0)  # copy-on-write pages: private to this process, the file is untouched
    assert torch.equal(art.load_tensor("fp32"), t)  # views of one opened file share memory
    art.close()
    assert t.sum().item() == pytest.approx((sample_tensors()["fp32"][2] + 1).sum().item())
    with pytest.raises(ArtifactError, match="closed"):
        art.load_tensor("fp32")
    assert path.read_bytes() == before
    assert torch.equal(open_container(path).load_tensor("fp32"), sample_tensors()["fp32"][2])


def test_load_weight_quantized_and_dequantized(tmp_path):
    qt = pytest.importorskip("ninfer_core.quant.tensor")
    path = tmp_path / "m.ninfer"
    tensors = write_sample(path, 3)
    art = open_container(path)
    for name in ("q4g64", "q5g64", "q6g64", "w8g32"):
        _, shape, data = tensors[name]
        weight = art.load_weight(name)
        assert isinstance(weight, qt.QuantizedTensor) and tuple(weight.shape) == shape
        assert torch.equal(weight.to_stored(), data)
        dense = art.load_tensor(name)
        assert dense.dtype == torch.float32 and tuple(dense.shape) == shape
    assert torch.equal(art.load_weight("bf16"), tensors["bf16"][2])


def test_missing_config_and_unknown_tensor(tmp_path):
    path = tmp_path / "m.ninfer"
    with ContainerWriter(path, version=1) as w:
        w.add_tensor("a", "fp16", (2,), torch.ones(2).half())
    art = open_container(path)
    with pytest.raises(ArtifactError, match=r"no config\.json resource"):
        _ = art.config
    with pytest.raises(ArtifactError, match="no tensor 'b'"):
        art.tensor_shape("b")
    with pytest.raises(ArtifactError, match="no component 'mtp'"):
        open_container(path, components={"mtp"})


# --- writer refusals -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"version": 1, "identity": IDENTITY}, "version 1 .ninfer has no identity"),
        ({"version": 1, "recipe": RECIPE}, "version 1 .ninfer has no identity or recipe"),
        ({"version": 2, "volume_limit": 100}, "need a version 3"),
        ({"version": 2, "artifact_id": bytes(16)}, "need a version 3"),
        ({"version": 2, "components": {"mtp": "x"}}, "need a version 3"),
        ({"version": 4}, "cannot write .ninfer version 4"),
        ({"identity": {"model_id": "m"}}, "exactly the keys model_id and weights_id"),
        ({"recipe": ["not", "an", "object"]}, "recipe must be a JSON object"),
        ({"recipe": {"x": float("nan")}}, "recipe is not plain JSON"),
        ({"artifact_id": b"short"}, "artifact_id must be 16 bytes"),
        ({"volume_limit": 0}, "volume_limit must be a positive int"),
    ],
)
def test_writer_refuses_bad_options(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ContainerWriter(tmp_path / "m.ninfer", **kwargs)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("t", "fp32", (4,), torch.ones(4).half()), "must be torch.float32 or torch.uint8"),
        (("t", "fp32", (4,), torch.ones(2, 2)), r"data has shape \[2, 2\], not \[4\]"),
        (("t", "fp32", (4,), torch.zeros(15, dtype=torch.uint8)), "takes 16 bytes, got 15"),
        (("t", "Q4G64", (2, 64), torch.ones(2, 64)), "stored bytes, not torch.float32"),
        (("t", "Q4G64", (128,), torch.zeros(64, dtype=torch.uint8)), "stores 2-D"),
        (("t", "Q3G64", (2, 64), b""), "unknown weight format 'Q3G64'; known formats: fp32"),
        (("t", "fp32", (-1,), b""), "outside 0"),
        (("t", "fp32", (4.0,), bytes(16)), r"shape \(4\.0,\) is not a list of ints"),
        (("", "fp32", (1,), bytes(4)), "1 to 1024 characters"),
        (("t", "fp32", (1,), bytes(4), "MTP!"), "component name"),
    ],
)
def test_writer_refuses_bad_tensors(tmp_path, args, match):
    with ContainerWriter(tmp_path / "m.ninfer") as w, pytest.raises(ValueError, match=match):
        w.add_tensor(*args)


def test_writer_refuses_other_components_before_v3_and_duplicates(tmp_path):
    with ContainerWriter(tmp_path / "a.ninfer", version=2) as w:
        with pytest.raises(ValueError, match="component 'mtp' needs a version 3"):
            w.add_tensor("t", "fp16", (1,), torch.ones(1).half(), component="mtp")
        w.add_resource("config.json", "{}")
        with pytest.raises(ValueError, match=r"duplicate object name 'config\.json'"):
            w.add_tensor("config.json", "fp16", (1,), torch.ones(1).half())


def test_a_failed_write_leaves_no_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "m.ninfer"
    write_sample(path, 3)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="boom"), ContainerWriter(path, volume_limit=300) as w:
        w.add_tensor("a", "fp32", (64,), torch.ones(64))
        w.add_tensor("b", "fp32", (64,), torch.ones(64))
        raise RuntimeError("boom")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ninfer"]


def test_writer_accepts_non_contiguous_dense_tensors(tmp_path):
    path = tmp_path / "m.ninfer"
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # [4, 3], not contiguous
    with ContainerWriter(path) as w:
        w.add_tensor("t", "fp32", (4, 3), t)
    assert torch.equal(open_container(path).load_tensor("t"), t)


# --- a real model served from one .ninfer file -----------------------------------------


def convert_folder(folder: Path, out: Path) -> None:
    """Every tensor of an HF folder (bf16, norms kept as fp32) and its text files."""
    src = open_hf_folder(folder)
    with ContainerWriter(out, identity={"model_id": folder.name, "weights_id": "test"}) as w:
        for name in ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json"):  # fmt: skip
            text = src.read_text(name)
            if text is not None:
                w.add_resource(name, text)
        for name in src.tensor_names():
            t = src.load_tensor(name)
            if name.endswith("norm.weight"):
                w.add_tensor(name, "fp32", t.shape, t.float())  # bf16 -> fp32 is exact
            else:
                w.add_tensor(name, "bf16", t.shape, t)


def test_a_ninfer_file_alone_serves_the_model(tmp_path):
    folder = write_tiny_qwen3(tmp_path / "hf", dtype=torch.bfloat16)
    write_model_dir(folder)
    out = tmp_path / "tiny.ninfer"
    convert_folder(folder, out)

    host, device = create_host(), probe_device(use_cuda=False)
    runtime = RuntimeConfig(dtype="fp32")
    ref = load_model(folder, host=host, device=device, runtime=runtime)
    got = load_model(out, host=host, device=device, runtime=runtime)
    assert isinstance(got.artifact, NinferArtifact)
    assert got.artifact.read_text("tokenizer.json") == (folder / "tokenizer.json").read_text()
    ids = torch.randint(0, 300, (24,), generator=_gen(3)).tolist()
    assert torch.equal(prompt_logits(got, ids), prompt_logits(ref, ids))
