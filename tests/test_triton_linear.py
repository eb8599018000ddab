"""The Triton backend's fused dequantize + GEMM (`backend_triton/linear.py` and
`linear_kernels.py`), run in Triton's interpreter, against float64 matrix products of
the quantizer's own dequantization (`QuantizedTensor.dequantize`), for every quantized
weight format; and the same kernels compiled for real GPUs (no GPU needed).

Shapes are odd on purpose: 37 output rows (not a multiple of any row block), 100 input
columns (not a multiple of the K block nor of the 32/64 group: the stored codes are
padded, and the GEMV splits K into two slices), 128 columns (no padding: a row's last
cell ends on its last byte) and 48 (the GEMV's single-slice path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import interpreted_module, run_compile_script

from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import QuantizedTensor, quantize

FORMATS = ("Q4G64", "Q5G64", "Q6G64", "W8G32", "Q4G32", "Q4G32M", "Q5G32", "Q5G32M")
OUT = 37
#: Largest error relative to the reference output's RMS.
TOLERANCE = {torch.float16: 1e-2, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def lin():
    return interpreted_module("ninfer_plugins.backend_triton.linear")


def _weight(fmt: str, cols: int, seed: int = 0) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(OUT, cols, generator=g)
    if weight_format(fmt).mins:
        w += 0.3  # off-centre groups: the mins carry real weight
    return quantize(w, fmt)


def _reference(x: torch.Tensor, q: QuantizedTensor, b: torch.Tensor | None) -> torch.Tensor:
    # float64: x @ dequantized(W)^T + b
    out = x.double() @ q.dequantize(torch.float64).T
    return out if b is None else out + b.double()


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    assert torch.isfinite(y).all()
    rms = ref.pow(2).mean().sqrt()
    err = (y.double() - ref).abs().max() / rms
    assert err <= TOLERANCE[dtype], f"max error {err:.2e} of the output RMS"


def _inputs(t: int, cols: int, dtype: torch.dtype, bias: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, cols, generator=g).to(dtype)
    b = torch.randn(OUT, generator=g).to(dtype) if bias else None
    return x, b


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_float64_reference(lin, fmt, dtype, t, bias):
    q = _weight(fmt, 100)
    w = lin.pack_linear(q, dtype=dtype)
    x, b = _inputs(t, 100, dtype, bias)
    # 1 and 7 rows run the GEMV (split into K slices), 33 the tensor-core GEMM
    assert (t <= lin.DECODE_MAX_ROWS) == (t < 33)
    _check(lin.linear(x, w, b), _reference(x, q, b), dtype)


@pytest.mark.parametrize("cols", [48, 128])
@pytest.mark.parametrize("t", [1, 33])
@pytest.mark.parametrize("fmt", FORMATS)
def test_whole_groups_and_single_slice(lin, fmt, t, cols):
    """128 columns: no padding, so the last cell of a row ends on its last byte. 48: the
    GEMV's single-slice path (one K slice, bias added in the GEMV itself)."""
    assert 48 <= lin.INTERPRET_K_PER_SPLIT < 100
    q = _weight(fmt, cols, seed=2)
    x, b = _inputs(t, cols, torch.float32, bias=True, seed=3)
    _check(lin.linear(x, lin.pack_linear(q), b), _reference(x, q, b), torch.float32)


def test_kernel_choice_follows_row_count(lin, monkeypatch):
    """Up to DECODE_MAX_ROWS rows take the GEMV, one more row takes the GEMM; each
    result still matches the reference."""
    ran: list[str] = []
    for name in ("_decode", "_prefill"):
        real = getattr(lin, name)

        def spy(*args, _real=real, _name=name):
            ran.append(_name)
            return _real(*args)

        monkeypatch.setattr(lin, name, spy)
    q = _weight("Q4G64", 100)
    w = lin.pack_linear(q)
    for t in (lin.DECODE_MAX_ROWS, lin.DECODE_MAX_ROWS + 1):
        x, b = _inputs(t, 100, torch.float32, bias=True)
        _check(lin.linear(x, w, b), _reference(x, q, b), torch.float32)
    assert ran == ["_decode", "_prefill"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_nbytes_is_what_pack_linear_holds(lin, fmt):
    for shape in ((OUT, 100), (64, 128)):
        q = quantize(torch.randn(*shape), fmt)
        packed = lin.pack_linear(q, dtype=torch.float16)
        want = lin.packed_nbytes(fmt, shape, dtype=torch.float16)
        assert packed.nbytes == want == weight_format(fmt).stored_nbytes(shape)


def test_dense_weights_stay_dense(lin):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(OUT, 100, generator=g)
    b = torch.randn(OUT, generator=g)
    x = torch.randn(5, 100, generator=g)
    assert lin.pack_linear(w) is w
    assert lin.packed_nbytes("fp16", (OUT, 100), dtype=torch.float16) is None
    ref = x.double() @ w.double().T + b.double()
    _check(lin.linear(x, w, b), ref, torch.float32)
    assert torch.equal(lin.linear(x, w, b), F.linear(x, w, b))


def test_leading_dims_and_unpacked_weight(lin):
    """x: [2, 3, in] -> [2, 3, out]; a `QuantizedTensor` that was never packed works too."""
    q = _weight("Q6G64", 100)
    x, b = _inputs(6, 100, torch.float16, bias=True)
    y = lin.linear(x.view(2, 3, 100), q, b)
    assert y.shape == (2, 3, OUT)
    _check(y.view(6, OUT), _reference(x, q, b), torch.float16)


def test_wrong_width_or_dtype_is_refused(lin):
    w = lin.pack_linear(_weight("Q4G32", 100))
    with pytest.raises(ValueError, match="100"):
        lin.linear(torch.randn(1, 96), w)
    with pytest.raises(TypeError, match="float64"):
        lin.linear(torch.randn(1, 100, dtype=torch.float64), w)


@pytest.mark.parametrize("t", [1, 33])
@pytest.mark.parametrize("fmt", ["Q5G64", "Q4G32M"])
def test_a_corrupted_code_byte_moves_its_row_only(lin, fmt, t):
    """Flipping bits of one code byte changes that output row, as the corrupted tensor's
    own dequantization says, and leaves every other row as it was: the kernels read
    the codes, and from the right place."""
    q = _weight(fmt, 100)
    x, _ = _inputs(t, 100, torch.float32, bias=False)
    before = lin.linear(x, lin.pack_linear(q))
    bad = QuantizedTensor(q.fmt, q.shape, q.packed.clone(), q.scales, q.mins)
    row, byte = 11, 20  # bytes 20 of a 5-bit row hold codes 32..33; of 4-bit, 40..41
    bad.packed[row, byte] ^= 0b1011_0110
    after = lin.linear(x, lin.pack_linear(bad))
    _check(after, _reference(x, bad, None), torch.float32)
    others = [r for r in range(OUT) if r != row]
    assert torch.equal(after[:, others], before[:, others])
    assert (after[:, row] - before[:, row]).abs().max() > 1e-3


# Compiled for real GPUs, in a process without the interpreter: the interpreter runs
# Python that Triton's compiler would refuse (and says nothing about tensor cores).
_COMPILE_SCRIPT = r"""
from triton_helpers import compile_for_gpu

import ninfer_plugins.backend_triton.linear_kernels as L

assert not L.INTERPRETED
ARGS = ("x_ptr codes_ptr scales_ptr mins_ptr bias_ptr out_ptr T N K stride_xt row_bytes "
        "n_groups").split()
MEM = {"codes_ptr": "*u8", "scales_ptr": "*fp16", "mins_ptr": "*fp16"}


def build(kernel, extra, act, out, consts, config, arch):
    sig = {a: MEM.get(a, f"*{act}") if a.endswith("ptr") else "i32" for a in ARGS + extra}
    sig["out_ptr"] = f"*{out}"
    return compile_for_gpu(kernel, sig, {**consts, **config.kwargs}, arch,
                           num_warps=config.num_warps, num_stages=config.num_stages)


def gemv(bits, group, mins, arch, rows=8, split=False):
    fmt = dict(BITS=bits, GROUP=group, HAS_MINS=mins, HAS_BIAS=not split, SPLIT=split)
    config = L.configs_for_group(L.DECODE_CONFIGS, {}, BLOCK_T=rows, GROUP=group)[0]
    out = "fp32" if split else "fp16"
    build(L.gemv_kernel, ["k_per_split"], "fp16", out, dict(fmt, BLOCK_T=rows), config, arch)


def gemm(bits, group, mins, arch, act="fp16"):
    fmt = dict(BITS=bits, GROUP=group, HAS_MINS=mins, HAS_BIAS=True, FP32_DOT=act == "fp32")
    config = L.configs_for_group(L.PREFILL_CONFIGS, {}, GROUP=group)[0]
    k = build(L.gemm_kernel, ["T_BUCKET"], act, act, dict(fmt, GROUP_M=8), config, arch)
    assert "mma" in k.asm["ptx"], "the prefill GEMM must run on tensor cores"


for bits, group, mins in ((4, 64, False), (5, 64, False), (6, 64, False), (8, 32, False),
                          (4, 32, True)):
    gemv(bits, group, mins, 90)
    gemm(bits, group, mins, 90)
gemv(5, 64, False, 90, rows=1, split=True)
gemm(6, 64, False, 90, act="fp32")
gemm(4, 32, True, 90, act="bf16")
gemv(6, 64, False, 86)
gemm(5, 64, False, 86)
reduce_sig = {"partial_ptr": "*fp32", "bias_ptr": "*fp16", "out_ptr": "*fp16", "numel": "i32",
              "N": "i32", "splits": "i32"}
compile_for_gpu(L.splitk_reduce_kernel, reduce_sig, {"HAS_BIAS": True, "BLOCK": 256}, 90)
print("compiled")
"""


def test_kernels_compile_for_gpus(tmp_path):
    """Every bit width's GEMV and GEMM (fp16, and the fp32 and bf16 variants) and the
    split-K reduction compile to cubins for SM90 (H100) and SM86, with no GPU here:
    ptxas ships with Triton."""
    assert "compiled" in run_compile_script(_COMPILE_SCRIPT, tmp_path)


def test_w8g16_is_dequantized_once_at_load(lin):
    # a GGUF's Q6_K codes (a scale per 16 columns): no kernel here reads them
    w = quantize(torch.randn(OUT, 64, generator=torch.Generator().manual_seed(3)), "W8G16")
    packed = lin.pack_linear(w, dtype=torch.float16)
    assert torch.equal(packed, w.dequantize(torch.float16))
    assert lin.packed_nbytes("W8G16", (OUT, 64), dtype=torch.float16) == OUT * 64 * 2
    x = torch.randn(3, 64)
    assert torch.allclose(lin.linear(x, w), _reference(x, w, None).float(), atol=1e-4)
