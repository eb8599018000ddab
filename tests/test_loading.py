"""Bad model folders fail at load with one clear line naming the file and the problem."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from checkpoints import write_tiny_qwen3
from safetensors.torch import load_file, save_file

from ninfer_core import hookimpl
from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.errors import ModelLoadError
from ninfer_core.loading import load_model, open_artifact
from ninfer_core.plugin_host import create_host


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("good"), dtype=torch.float32)


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def load(path: Path):
    host = create_host()
    return load_model(path, host=host, device=probe_device(), runtime=RuntimeConfig(dtype="fp32"))


def cli_error(path: Path, capsys) -> str:
    code = main(["generate", str(path), "--prompt", "hi", "--raw", "--max-new", "2"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ninfer generate: error: ")
    return lines[0]


def test_good_folder_loads(good_dir):
    loaded = load(good_dir)
    assert loaded.config.architecture == "Qwen3ForCausalLM"
    assert loaded.backend == "torch"


def test_missing_tensor(good_dir, tmp_path, capsys):
    bad = copy_dir(good_dir, tmp_path / "bad")
    weights = load_file(bad / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, bad / "model.safetensors")
    line = cli_error(bad, capsys)
    assert "model.layers.1.mlp.down_proj.weight" in line and "missing" in line


def test_wrong_shape(good_dir, tmp_path, capsys):
    bad = copy_dir(good_dir, tmp_path / "bad")
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(weights, bad / "model.safetensors")
    line = cli_error(bad, capsys)
    assert "model.layers.0.self_attn.o_proj.weight" in line
    assert "64, 32" in line and "64, 64" in line


def test_unknown_architecture(good_dir, tmp_path, capsys):
    bad = copy_dir(good_dir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    line = cli_error(bad, capsys)
    assert "config.json" in line and "GPTNeoXForCausalLM" in line
    assert "Qwen3ForCausalLM" in line  # lists what is known


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b"\xff" * 8 + b[8:],  # header length far past the end of the file
        lambda b: b[:8] + b"{not json" + b[17:],  # header bytes that are not JSON
        lambda b: b[: len(b) // 2],  # truncated: tensors run past the end
    ],
    ids=["length", "json", "truncated"],
)
def test_corrupt_safetensors_header(good_dir, tmp_path, capsys, damage):
    bad = copy_dir(good_dir, tmp_path / "bad")
    file = bad / "model.safetensors"
    file.write_bytes(damage(file.read_bytes()))
    line = cli_error(bad, capsys)
    assert "model.safetensors" in line and "corrupt safetensors header" in line


def test_pickle_checkpoint_is_refused(good_dir, tmp_path, capsys):
    bad = copy_dir(good_dir, tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    (bad / "pytorch_model.bin").write_bytes(b"not really a pickle")
    line = cli_error(bad, capsys)
    assert "pytorch_model.bin" in line and "safetensors" in line and "refused" in line


def test_broken_config_json(good_dir, tmp_path, capsys):
    bad = copy_dir(good_dir, tmp_path / "bad")
    (bad / "config.json").write_text("{")
    assert "config.json" in cli_error(bad, capsys)


def test_missing_path_and_unreadable_formats(tmp_path):
    host = create_host()
    with pytest.raises(ModelLoadError, match="no such file"):
        open_artifact(host, tmp_path / "nope")
    odd = tmp_path / "model.onnx"
    odd.write_bytes(b"ONNX")
    with pytest.raises(ModelLoadError, match=r"no artifact reader recognises it; readers: .*hf-"):
        open_artifact(host, odd)
    stub = tmp_path / "model.gguf"  # the gguf reader claims it, and says what is wrong
    stub.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="truncated GGUF file"):
        open_artifact(host, stub)


def test_artifact_readers_come_from_register_artifact_readers(good_dir):
    """A reader registered through `register_artifact_readers` opens what it claims."""
    opened: list[Path] = []

    class MarkerReader:
        name = "marker"
        description = "folders with a MARKER file"

        def supports(self, device):
            from ninfer_core.support import Support

            return Support.yes()

        def can_read(self, path: Path) -> bool:
            return (path / "MARKER").exists()

        def open(self, path: Path):
            opened.append(path)
            from ninfer_plugins.artifact_safetensors import open_hf_folder

            return open_hf_folder(path)

    @hookimpl
    def register_artifact_readers():
        return [MarkerReader()]

    plugin = types.SimpleNamespace(register_artifact_readers=register_artifact_readers)
    host = create_host(load_entry_points=False, extra_plugins=[("marker", plugin)])
    assert host.artifact_readers.names() == ["marker"]
    with pytest.raises(ModelLoadError, match="readers: marker"):
        open_artifact(host, good_dir)
    (good_dir / "MARKER").write_text("")
    try:
        assert open_artifact(host, good_dir).config["model_type"] == "qwen3"
    finally:
        (good_dir / "MARKER").unlink()
    assert opened == [good_dir]
