"""W8A8 / W4A8 prefill GEMM (`--activation-dtype int8`): activations quantized per token
to int8, multiplied with the weight's 8- or 4-bit group codes on integer tensor cores.

The math is `ninfer_core.kernels.int8_act`'s (its docstring is the spec; the tests hold
these kernels to it). Two kernels:

- `_quantize_rows_kernel`: one program per token row; a first pass finds `max|x|`, a
  second writes `xq = round_half_even(x / sx)` as int8 (`sx = max|x| / 127`, both IEEE
  divisions via `div_rn`, as torch divides), zero-padded to the weight's padded width.
  Rounding adds and subtracts 1.5 * 2^23, which rounds an fp32 of magnitude below 2^22
  half to even in one step (libdevice's `rint` has no interpreter implementation).
- `_int8_gemm_kernel`: a `[BLOCK_M, BLOCK_N]` output tile; for each weight group it loads
  `[BLOCK_M, group]` int8 activations and `[group, BLOCK_N]` codes unpacked from the stored
  bytes (`ninfer_core.quant.formats`: per row a little-endian stream of offset-binary
  codes: one byte per 8-bit code, two 4-bit codes a byte, low nibble first) and calls
  `tl.dot(int8, int8) -> int32`, which is exact (integer MMA on SM80+); the group's
  fp16 scale then weighs that int32 tile into an fp32 accumulator. The epilogue multiplies
  by the row's `sx`, adds the bias and casts to the activations' dtype.

Triton's interpreter runs integer `tl.dot` exactly (numpy integer matmul), so the tests
exercise this very code on the CPU; no float stand-in is needed. Symmetric formats only
(`table.INT8_ACT_FORMATS`): Q4G32M's min term and 5/6-bit codes are refused by
`TritonBackend.provides` for int8 activations (the torch reference runs them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer_core.kernels.int8_act import QMAX
from ninfer_core.quant.formats import weight_format
from ninfer_plugins.backend_triton.table import INT8_ACT_FORMATS, interpreting

#: Columns per step of the row-quantizing kernel.
_QUANT_BLOCK = 1024


# Only Triton builtins inside the kernels (`tl.full`, `tl.reduce` with our own combine):
# `tl.zeros` and `tl.max` are themselves jit functions, decorated when Triton is first
# imported, and a process that imported Triton before turning its interpreter on cannot
# call them interpreted.


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, xq_ptr, sx_ptr, K, KP, stride_x, stride_q, BLOCK: tl.constexpr, QMAX: tl.constexpr
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    amax = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    sx = tl.math.div_rn(tl.reduce(amax, 0, _larger), QMAX * 1.0)
    safe = tl.where(sx > 0.0, sx, 1.0)
    tl.store(sx_ptr + row, sx)
    q_row = xq_ptr + row.to(tl.int64) * stride_q
    for start in range(0, KP, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        # + 1.5 * 2^23 - 1.5 * 2^23: round half to even (|v / sx| <= 127)
        q = (tl.math.div_rn(v, safe) + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
        tl.store(q_row + cols, q.to(tl.int8), mask=cols < KP)


@triton.jit
def _int8_gemm_kernel(
    xq_ptr,
    sx_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    KP,
    stride_q,
    stride_w,
    stride_s,
    stride_y,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    m_ok = rm < M
    n_ok = rn < N
    # xq: [M, KP] int8 (zero-padded), codes: [N, KP * BITS / 8] uint8, scales: [N, KP / GROUP]
    x_rows = xq_ptr + rm.to(tl.int64)[:, None] * stride_q
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_w
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for g in range(0, KP // GROUP):
        k = g * GROUP + rk
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0)  # int8 [BM, G]
        if BITS == 8:
            raw = tl.load(w_rows + k[:, None], mask=n_ok[None, :], other=128)  # [G, BN]
            codes = (raw.to(tl.int32) - 128).to(tl.int8)
        else:  # two codes a byte, low nibble first
            raw = tl.load(w_rows + k[:, None] // 2, mask=n_ok[None, :], other=0x88)
            nibble = (raw.to(tl.int32) >> ((k[:, None] % 2) * 4)) & 15
            codes = (nibble - 8).to(tl.int8)
        part = tl.dot(a, codes, out_dtype=tl.int32)  # [BM, BN], exact
        scale = tl.load(s_ptr + rn.to(tl.int64) * stride_s + g, mask=n_ok, other=0.0)
        acc += part.to(tl.float32) * scale.to(tl.float32)[None, :]
    sx = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
    acc = acc * sx[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


#: (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner on a GPU.
_GPU_CONFIGS = ((64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3))
#: The one tile the interpreter runs (autotuning cannot run there).
_INTERPRETED = {"BLOCK_M": 32, "BLOCK_N": 32}
#: Read once, at import, as Triton read it when it decorated the kernels above.
_INTERPRETING = interpreting()

if _INTERPRETING:
    _gemm = _int8_gemm_kernel
else:  # keyed on the weight's shape; a prefill's row count varies from call to call
    _gemm = triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in _GPU_CONFIGS
        ],
        key=["N", "KP", "BITS", "GROUP"],
        cache_results=True,  # the choice per shape is kept on disk: tuned once per machine
    )(_int8_gemm_kernel)


def quantize_rows(x: torch.Tensor, padded_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] float -> (xq int8 [T, padded_cols], zero past K; sx fp32 [T]), the numbers
    of `int8_act.quantize_activations`."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x {list(x.shape)} strides {x.stride()}"
    t, k = x.shape
    xq = torch.empty(t, padded_cols, dtype=torch.int8, device=x.device)
    sx = torch.empty(t, dtype=torch.float32, device=x.device)
    if t:
        _quantize_rows_kernel[(t,)](
            x, xq, sx, k, padded_cols, x.stride(0), xq.stride(0), BLOCK=_QUANT_BLOCK, QMAX=QMAX
        )
    return xq, sx


def int8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt_name: str,
    out_features: int,
    b: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, in] float; `codes` uint8 `[out, padded_in * bits / 8]` and `scales` fp16
    `[out, padded_in / group]`, the stored layout of a `fmt_name` weight (one of
    `INT8_ACT_FORMATS`) -> [T, out] in x.dtype (+ bias `b`: [out])."""
    if fmt_name not in INT8_ACT_FORMATS:
        known = ", ".join(sorted(INT8_ACT_FORMATS))
        raise ValueError(f"no int8-activation GEMM for {fmt_name} weights (reads {known})")
    fmt = weight_format(fmt_name)
    padded = fmt.padded_cols(x.shape[1])
    assert codes.shape == (out_features, padded * fmt.bits // 8) and codes.stride(1) == 1
    assert scales.shape == (out_features, padded // fmt.group) and scales.stride(1) == 1
    assert b is None or b.shape == (out_features,)
    if x.stride(-1) != 1:
        x = x.contiguous()
    xq, sx = quantize_rows(x, padded)
    t = x.shape[0]
    y = torch.empty(t, out_features, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    bias = b.contiguous() if b is not None else sx  # any pointer when HAS_BIAS is off
    args = (xq, sx, codes, scales, bias, y, t, out_features, padded)
    args += (xq.stride(0), codes.stride(0), scales.stride(0), y.stride(0))
    consts = {"BITS": fmt.bits, "GROUP": fmt.group, "HAS_BIAS": b is not None}

    def grid(meta):
        return (triton.cdiv(t, meta["BLOCK_M"]), triton.cdiv(out_features, meta["BLOCK_N"]))

    if _INTERPRETING:
        _gemm[grid](*args, **consts, **_INTERPRETED)
    else:
        _gemm[grid](*args, **consts)
    return y
