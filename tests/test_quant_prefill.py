"""`Int4Linear`'s two paths: the int4 kernel (few rows) and the dense prefill path.

Both are checked against a float64 oracle (the bf16 activations times the exactly
dequantized weight), on shapes with padded columns and a row count that is neither a
multiple of the kernel's 64-row blocks nor of 16, over several dequantized chunks.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import prompt_logits, write_tiny_qwen3

from ninfer_core.config import RuntimeConfig
from ninfer_core.convert import convert
from ninfer_core.device import probe_device
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.quant.tensor import quantize
from ninfer_plugins.backend_torch import _INT4_CPU, Int4Linear, int4_layout_known, unpack_int4pack

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not _INT4_CPU, reason="this torch has no CPU int4 kernel"),
]

#: Relative RMS error of a bf16 output against float64: the output's own rounding
#: (2^-9) and, on the dense path, the weight's rounding to bf16 (2^-9 more).
TOLERANCE = 6e-3
FORMATS = ["Q4G64", "Q5G64", "Q6G64", "W8G32"]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def oracle(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    ref = x.double() @ w.dequantize(torch.float64).t()
    return ref if bias is None else ref + bias.double()


def test_the_packed_layout_is_the_one_unpacked():
    assert int4_layout_known()
    q = torch.randint(0, 16, (208, 192), generator=torch.Generator().manual_seed(1))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
    for start, n in [(0, 208), (64, 64), (128, 72), (192, 16)]:  # 3 blocks + a 16-row tail
        got = unpack_int4pack(packed, 208, start, n)  # [K, n]
        assert torch.equal(got.t().long(), q[start : start + n])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_and_dense_paths_match_a_float64_reference(fmt, bias):
    gen = torch.Generator().manual_seed(0)
    rows, cols = 300, 96  # 300 rows: a 44-row tail block; 96 columns pad to 128
    w = quantize(torch.randn(rows, cols, generator=gen), fmt)
    b = torch.randn(rows, generator=gen).bfloat16() if bias else None
    layer = Int4Linear(w)
    layer.DENSE_CHUNK_ELEMS = 128 * 128  # several 64-row chunks and a partial last one
    for t in (1, 5, layer.DENSE_MIN_ROWS, layer.DENSE_MIN_ROWS + 1, 130):
        x = torch.randn(t, cols, generator=gen).bfloat16()
        got = layer(x, b)
        assert got.shape == (t, rows) and got.dtype == torch.bfloat16
        assert rel_err(got, oracle(x, w, b)) < TOLERANCE, (fmt, t)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_weight_is_the_kernels_weight(fmt):
    # what the dense path multiplies by is code * bf16(scale), exactly
    w = quantize(torch.randn(130, 200, generator=torch.Generator().manual_seed(2)), fmt)
    layer = Int4Linear(w)
    scales = w.scales.to(torch.bfloat16).float().repeat_interleave(w.fmt.group, dim=1)
    want = w.codes().float() * scales  # [rows, padded_cols]
    got = torch.cat([layer.dequantize_t(0, 128), layer.dequantize_t(128, 2)], dim=1)
    assert torch.equal(got.t(), want)


def test_a_quantized_model_prefills_alike_on_both_paths(tmp_path, monkeypatch):
    folder = write_tiny_qwen3(tmp_path / "hf", dtype=torch.bfloat16)
    out = tmp_path / "mixed.ninfer"
    convert(folder, out, recipe_name="mixed")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (Int4Linear.DENSE_MIN_ROWS + 30,), generator=gen).tolist()

    def logits() -> torch.Tensor:
        loaded = load_model(
            out, host=create_host(), device=probe_device(use_cuda=False),
            runtime=RuntimeConfig(dtype="bf16"),
        )  # fmt: skip
        return prompt_logits(loaded, ids)

    dense = logits()
    monkeypatch.setattr(Int4Linear, "DENSE_MIN_ROWS", 10**9)  # the kernel for every batch
    kernel = logits()
    assert rel_err(dense, kernel.double()) < 0.03
    assert (dense.argmax(-1) == kernel.argmax(-1)).float().mean() > 0.9
