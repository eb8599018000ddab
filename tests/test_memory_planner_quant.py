"""The planner's weight bytes for a quantized `.ninfer`: from object sizes and the packing.

A hand computation of every tensor's bytes, on a tiny checkpoint whose widths are not
multiples of the group (padded columns) and whose vocabulary is not a multiple of 16
(the int4 kernel's padded rows), against `ninfer plan` and the loaded model itself.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import write_tiny_qwen3

from ninfer_core.cli.main import main
from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import convert
from ninfer_core.device import probe_device
from ninfer_core.kernels import cpu_gemv
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import quantize
from ninfer_plugins.backend_torch import _INT4_CPU, Int4Linear, TorchOps

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, FF, V, LAYERS, Q, KV, D = 96, 160, 300, 3, 64, 32, 16
#: format per role (qkv, o, gate_up, down, embed) for each recipe under test
RECIPES = {
    "q4": dict.fromkeys(("qkv", "o", "gate_up", "down", "embed"), "Q4G64"),
    "mixed": {"qkv": "Q4G64", "o": "Q5G64", "gate_up": "Q4G64", "down": "Q5G64",
              "embed": "Q6G64"},
    "w8": dict.fromkeys(("qkv", "o", "gate_up", "down", "embed"), "W8G32"),
}  # fmt: skip
SHAPES = {"qkv": (Q + 2 * KV, H), "o": (H, Q), "gate_up": (2 * FF, H), "down": (H, FF)}
NORM_WEIGHTS = LAYERS * (2 * H + 2 * D) + H


def stored(fmt_name: str, rows: int, cols: int) -> int:
    """Codes (bits each, columns padded to the group) and one fp16 scale a group."""
    fmt = weight_format(fmt_name)
    kp = -(-cols // fmt.group) * fmt.group
    return rows * kp * fmt.bits // 8 + rows * (kp // fmt.group) * 2


def int4_packed(fmt_name: str, rows: int, cols: int) -> int:
    """What CPU bf16 holds. 4-, 5- and 6-bit codes on the Q4 GEMV: half a byte a code,
    an eighth of a byte per bit beyond 4, and an fp16 scale per group. 8-bit codes on the
    Q8 GEMV: the stored codes and scales themselves. Otherwise torch's int4 kernel: half
    a byte a code (two codes for 5-8 bits), rows up to 16, bf16 scale + zero."""
    fmt = weight_format(fmt_name)
    kp = -(-cols // fmt.group) * fmt.group
    if fmt.bits <= 6 and cpu_gemv.available():
        codes = rows * kp // 2 + rows * kp // 8 * (fmt.bits - 4)
        return codes + rows * (kp // fmt.group) * 2 * (2 if fmt.mins else 1)
    if fmt.bits == 8 and cpu_gemv.available():
        return stored(fmt_name, rows, cols)
    k = kp * (2 if fmt.bits > 4 else 1)
    n = -(-rows // 16) * 16
    return n * k // 2 + n * (k // fmt.group) * 4


def dense(fmt_name: str, rows: int, cols: int, size: int = 4) -> int:
    """Dequantized once at load: `size` bytes a weight (fp32 compute)."""
    return rows * cols * size


def by_hand(recipe: str, packed: bool, dense_size: int) -> int:
    """bf16 (`packed`): every projection and a copy of the tied head on the int4 kernel;
    fp32: every projection and the head copy dequantized once, to fp32. The embedding
    table stays as stored either way (a lookup dequantizes only its rows)."""
    fmts = RECIPES[recipe]
    size = int4_packed if packed else dense
    layers = LAYERS * sum(size(fmts[role], *shape) for role, shape in SHAPES.items())
    embed = stored(fmts["embed"], V, H)
    head_copy = size(fmts["embed"], V, H)  # tied: the head is packed as its own copy
    if packed and weight_format(fmts["embed"]).bits == 8 and cpu_gemv.available():
        head_copy = 0  # ... but the Q8 GEMV's head holds the embedding's own codes
    return layers + embed + head_copy + NORM_WEIGHTS * dense_size


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    folder = write_tiny_qwen3(
        root / "hf", dtype=torch.bfloat16, hidden_size=H, intermediate_size=FF,
        max_position_embeddings=512,
    )  # fmt: skip
    out = {}
    for name in RECIPES:
        out[name] = root / f"{name}.ninfer"
        convert(folder, out[name], recipe_name=name)
    return out


def _plan(path, dtype: str, capsys) -> int:
    args = ["plan", str(path), "--device-spec", "cpu", "--dtype", dtype, "--json",
            "--max-context", "256", "--memory-budget", "1"]  # fmt: skip
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)["weights_bytes"]


def _held(path, dtype: str) -> int:
    loaded = load_model(
        path, host=create_host(), device=probe_device(use_cuda=False),
        runtime=RuntimeConfig(dtype=dtype),
    )  # fmt: skip
    return loaded.model.weight_bytes()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp32_holds_the_matrices_dequantized_once(artifacts, recipe, capsys):
    # fp32 compute: no int4 kernel; projections become dense fp32 at load (never per
    # step), the embedding table stays as stored, norms become fp32
    want = by_hand(recipe, packed=False, dense_size=4)
    assert _plan(artifacts[recipe], "fp32", capsys) == want
    assert _held(artifacts[recipe], "fp32") == want


@pytest.mark.skipif(not _INT4_CPU, reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_cpu_bf16_holds_the_int4_packing(artifacts, recipe, capsys):
    want = by_hand(recipe, packed=True, dense_size=2)
    assert _plan(artifacts[recipe], "bf16", capsys) == want
    assert _held(artifacts[recipe], "bf16") == want
    # and it is well under what the bf16 weights would take
    assert want < (LAYERS * sum(r * c for r, c in SHAPES.values()) + V * H) * 2


@pytest.mark.skipif(not _INT4_CPU, reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("fmt", ["Q4G64", "Q5G64", "Q6G64", "W8G32"])
@pytest.mark.parametrize("shape", [(16, 64), (300, 96), (40, 160)])
def test_int4_size_from_the_shape_is_the_built_size(fmt, shape):
    w = quantize(torch.randn(*shape), fmt)
    assert Int4Linear.nbytes_for(w.fmt, shape) == Int4Linear(w).nbytes
    ops = TorchOps("cpu")
    held = ops.packed_nbytes(fmt, shape, dtype=torch.bfloat16)
    # None: the layer holds the loaded tensors themselves
    assert (w.nbytes if held is None else held) == ops.pack_linear(w, dtype=torch.bfloat16).nbytes
    # fp32: dequantized once at load
    assert ops.packed_nbytes(fmt, shape, dtype=torch.float32) == shape[0] * shape[1] * 4
