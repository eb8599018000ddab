"""The memory plan's weight bytes for the hybrid family equal what the loaded model holds.

For a tiny Qwen3.5 (dense MLPs), Qwen3.5-MoE and Qwen3-Next (MoE with one dense layer),
from the folder and from `.ninfer` conversions (`w8`, `mixed`, `q4`), in fp32 and bf16 on
the CPU: `ninfer plan --json`'s `weights_bytes` (from headers alone) equals the storage
the loaded model keeps, counted here independently of the model's own `weight_bytes`:
every tensor storage reachable from its modules (parameters, buffers, attributes, and
the tensors inside packed or quantized weights), each storage once. That catches what
a count of objects or parameters would not: a norm holding w and `1 + w` both, a
quantized router or DeltaNet projection dequantized at load, fp32 vectors in a bf16
model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hybrid_family import write_tiny_qwen3_next
from test_hybrid_qwen3_5 import write_tiny_qwen3_5

from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import convert
from ninfer_core.device import probe_device
from ninfer_core.loading import load_model
from ninfer_core.model.rope import RotaryEmbedding
from ninfer_core.plugin_host import create_host

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = {
    "qwen3.5-dense": lambda path: write_tiny_qwen3_5(path, "dense"),
    "qwen3.5-moe": lambda path: write_tiny_qwen3_5(path, "moe"),
    "qwen3-next": write_tiny_qwen3_next,
}
RECIPES = (None, "w8", "mixed", "q4")


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct tensor storage `model`'s modules reach, the RoPE module's
    frequency buffer aside (not a weight: `rotary_dim / 2` fp32 values the plan leaves
    to its workspace). A strided tensor counts its whole storage (a view keeps it all
    alive), once however many tensors share it; an opaque one (oneDNN's blocked layout)
    its elements."""
    seen: set[Any] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if t.layout == torch.strided:
            storage = t.untyped_storage()
            key, size = ("storage", storage.data_ptr()), storage.nbytes()
        else:
            key, size = ("opaque", id(t)), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += size

    def visit(value: Any) -> None:
        """A tensor, or the tensors of a packed / quantized weight object (one level)."""
        if isinstance(value, torch.Tensor):
            add(value)
        elif type(value).__module__.startswith("ninfer") and not isinstance(value, torch.nn.Module):
            slots = getattr(type(value), "__slots__", ())
            fields = [*getattr(value, "__dict__", {}).values()]
            fields += [getattr(value, n, None) for n in slots]
            for field in fields:
                if isinstance(field, torch.Tensor):
                    add(field)

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            continue
        for value in (*module._parameters.values(), *module._buffers.values()):
            if value is not None:
                add(value)
        for name, value in vars(module).items():
            if name != "ops" and not name.startswith("_"):
                visit(value)
    return total


@pytest.fixture(scope="module", params=list(MODELS))
def artifacts(request, tmp_path_factory) -> dict[str | None, Path]:
    """The folder (key None) and its conversions by recipe."""
    root = tmp_path_factory.mktemp(request.param)
    folder = root / "hf"
    folder.mkdir()
    MODELS[request.param](folder)
    out: dict[str | None, Path] = {None: folder}
    for recipe in RECIPES[1:]:
        out[recipe] = root / f"{recipe}.ninfer"
        convert(folder, out[recipe], recipe_name=recipe)
    return out


def planned(path: Path, dtype: str, capsys) -> int:
    args = ["plan", str(path), "--device-spec", "cpu", "--dtype", dtype, "--json",
            "--max-context", "256", "--memory-budget", "1"]  # fmt: skip
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)["weights_bytes"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r or "folder")
def test_the_plan_declares_the_bytes_the_loaded_model_holds(artifacts, recipe, dtype, capsys):
    path = artifacts[recipe]
    loaded = load_model(
        path, host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype=dtype),
    )  # fmt: skip
    held = storage_bytes(loaded.model)
    assert planned(path, dtype, capsys) == held
    assert loaded.model.weight_bytes() == held


def test_a_zero_centred_norm_holds_one_fp32_vector(artifacts):
    """`1 + w` replaces w in place: one fp32 parameter, nothing beside it."""
    loaded = load_model(
        artifacts[None], host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype="bf16"),
    )  # fmt: skip
    norm = loaded.model.norm
    assert norm.finalized and norm.weight.dtype == torch.float32
    tensors = [v for v in vars(norm).values() if isinstance(v, torch.Tensor)]
    assert [*norm.parameters()] == [norm.weight] and not tensors
