"""The Triton kernels behind `linear.py`: NInfer's group codes dequantized in registers
and multiplied, as a GEMV (decode) and a tensor-core GEMM (prefill), plus the split-K
reduction; `linear.py` packs the weights, picks a kernel and launches it.

Codes are read as whole cells (8 / gcd(8, bits) codes: 2 in a byte at 4 bits, 8 in 5
bytes at 5, 4 in 3 bytes at 6, 1 at 8) with contiguous byte loads, so no code straddles
a load, and every K block lies inside one group, so one scale (and min) a row covers it.
The autotune lists are small and keyed on the problem's sizes; under Triton's
interpreter (tests) each holds one fixed config, since the interpreter cannot benchmark.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ninfer_plugins.backend_triton.table import interpreting

#: Most elements of the GEMV product tile `[BLOCK_T, BLOCK_N, BLOCK_K]` a thread holds.
_GEMV_THREAD_ELEMS = 64
#: Whether this module's kernels were decorated for Triton's interpreter (decided at
#: import, as Triton decides it; the environment may change afterwards).
INTERPRETED = interpreting()

if INTERPRETED:
    # The interpreter cannot benchmark: one small config each, so tests stay fast and
    # still cover ragged edges and several K steps.
    DECODE_CONFIGS = [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32})]
    PREFILL_CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32})]
else:
    # BLOCK_K must divide the group (32 or 64): configs with a larger one are pruned.
    DECODE_CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in (
            (32, 64, 4, 3),
            (64, 64, 4, 3),
            (128, 32, 4, 3),
            (64, 32, 4, 4),
            (128, 64, 8, 3),
            (32, 32, 4, 4),
            (16, 32, 2, 4),
        )
    ]
    PREFILL_CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in (
            (64, 64, 32, 4, 4),
            (64, 128, 32, 8, 4),
            (128, 64, 32, 8, 4),
            (128, 128, 32, 8, 3),
            (64, 128, 64, 8, 3),
            (128, 128, 64, 8, 3),
        )
    ]


# Only Triton builtins inside: `tl.sum`, `tl.zeros` and `tl.cdiv` are themselves jit
# functions, decorated when Triton is first imported, and a process that imported Triton
# before turning its interpreter on (torch._dynamo does) cannot call them interpreted.
# `tl.reduce` with Triton's own `_sum_combine` is what `tl.sum` compiles to, and the
# interpreter recognises that combiner (a numpy sum, not its per-element slow path).


@triton.jit
def _stored_codes(
    codes_ptr,
    rows,
    row_mask,
    k0,
    row_bytes,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """int32 [BLOCK_N, BLOCK_K]: the stored values (0 .. 2^BITS - 1) of columns
    `k0 .. k0 + BLOCK_K` of `rows` ([BLOCK_N, 1] int64).

    A row's bit stream is read as whole cells of 8 / gcd(8, BITS) codes (1, 2, 4 or 8
    codes in 1, 1, 3 or 5 bytes): contiguous byte loads, then shifts and masks in
    registers, then `tl.join` puts the codes of a cell back side by side. `k0` is a
    multiple of BLOCK_K, which divides the group, so the block lies inside the padded
    row and only rows need masks."""
    row_ptr = codes_ptr + rows * row_bytes
    if BITS == 8:
        cols = tl.arange(0, BLOCK_K)[None, :]
        value = tl.load(row_ptr + k0 + cols, mask=row_mask, other=0).to(tl.int32)
    elif BITS == 4:
        # byte i: code 2i in the low nibble, 2i + 1 in the high one
        cells = row_ptr + k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :]
        b0 = tl.load(cells, mask=row_mask, other=0).to(tl.int32)
        value = tl.reshape(tl.join(b0 & 15, b0 >> 4), [BLOCK_N, BLOCK_K])
    elif BITS == 6:
        # 4 codes in 3 bytes: code j at bits 6j .. 6j + 5 of the 24-bit cell
        cells = row_ptr + (k0 // 4) * 3 + tl.arange(0, BLOCK_K // 4)[None, :] * 3
        b0 = tl.load(cells, mask=row_mask, other=0).to(tl.int32)
        b1 = tl.load(cells + 1, mask=row_mask, other=0).to(tl.int32)
        b2 = tl.load(cells + 2, mask=row_mask, other=0).to(tl.int32)
        c0 = b0 & 63
        c1 = (b0 >> 6) | ((b1 & 15) << 2)
        c2 = (b1 >> 4) | ((b2 & 3) << 4)
        c3 = b2 >> 2
        # joined[..., p, r] = c[2p + r]
        value = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [BLOCK_N, BLOCK_K])
    else:
        tl.static_assert(BITS == 5, "codes of 4, 5, 6 or 8 bits")
        # 8 codes in 5 bytes: code j at bits 5j .. 5j + 4 of the 40-bit cell
        cells = row_ptr + (k0 // 8) * 5 + tl.arange(0, BLOCK_K // 8)[None, :] * 5
        b0 = tl.load(cells, mask=row_mask, other=0).to(tl.int32)
        b1 = tl.load(cells + 1, mask=row_mask, other=0).to(tl.int32)
        b2 = tl.load(cells + 2, mask=row_mask, other=0).to(tl.int32)
        b3 = tl.load(cells + 3, mask=row_mask, other=0).to(tl.int32)
        b4 = tl.load(cells + 4, mask=row_mask, other=0).to(tl.int32)
        c0 = b0 & 31
        c1 = (b0 >> 5) | ((b1 & 3) << 3)
        c2 = (b1 >> 2) & 31
        c3 = (b1 >> 7) | ((b2 & 15) << 1)
        c4 = (b2 >> 4) | ((b3 & 1) << 4)
        c5 = (b3 >> 1) & 31
        c6 = (b3 >> 6) | ((b4 & 7) << 2)
        c7 = b4 >> 3
        # joined[..., p, q, r] = c[4p + 2q + r]
        even = tl.join(tl.join(c0, c4), tl.join(c2, c6))
        odd = tl.join(tl.join(c1, c5), tl.join(c3, c7))
        value = tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_K])
    return value


@triton.jit
def _dequant_block(
    codes_ptr,
    scales_ptr,
    mins_ptr,
    rows,
    row_mask,
    k0,
    row_bytes,
    n_groups,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_K] weights of `rows` ([BLOCK_N, 1] int64) at columns
    `k0 .. k0 + BLOCK_K`, all in one group: one scale (and min) per row."""
    tl.static_assert(GROUP % BLOCK_K == 0, "a K block must lie inside one group")
    value = _stored_codes(codes_ptr, rows, row_mask, k0, row_bytes, BITS, BLOCK_N, BLOCK_K)
    group = rows * n_groups + k0 // GROUP  # [BLOCK_N, 1]
    scale = tl.load(scales_ptr + group, mask=row_mask, other=0.0).to(tl.float32)
    if HAS_MINS:
        low = tl.load(mins_ptr + group, mask=row_mask, other=0.0).to(tl.float32)
        return value.to(tl.float32) * scale + low  # u * scale + min: u is the stored value
    return (value - (1 << (BITS - 1))).to(tl.float32) * scale


def configs_for_group(configs: list, named_args: dict, **kwargs) -> list:
    """The configs whose BLOCK_K divides the weight's group (a K block then has one
    scale per row) and, for the GEMV, whose `[BLOCK_T, BLOCK_N, BLOCK_K]` product stays
    within `_GEMV_THREAD_ELEMS` a thread (more spills registers); at least the smallest."""
    rows = kwargs.get("BLOCK_T", 1)
    group = kwargs["GROUP"]

    def tile(c: triton.Config) -> int:
        return c.kwargs.get("BLOCK_M", rows) * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"]

    fit = [c for c in configs if group % c.kwargs["BLOCK_K"] == 0]
    small = [
        c for c in fit if "BLOCK_M" in c.kwargs or tile(c) <= _GEMV_THREAD_ELEMS * 32 * c.num_warps
    ]
    return small or [min(fit, key=tile)]


@triton.autotune(
    configs=DECODE_CONFIGS,
    key=["N", "K", "BLOCK_T", "SPLIT"],
    prune_configs_by={"early_config_prune": configs_for_group},
    cache_results=True,  # the choice per shape is kept on disk: tuned once per machine
)
@triton.jit
def gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    T,
    N,
    K,
    stride_xt,
    row_bytes,
    n_groups,
    k_per_split,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[t, n] = sum_k x[t, k] * w[n, k] over this program's K slice; with SPLIT the
    fp32 partial goes to out[slice, t, n] (no bias), else the result in out's dtype."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    rows = offs_n.to(tl.int64)[:, None]
    row_mask = rows < N
    acc = tl.full([BLOCK_T, BLOCK_N], 0.0, tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_end
        # w: [BLOCK_N, BLOCK_K], x: [BLOCK_T, BLOCK_K] (zero past K: padded codes count 0)
        w = _dequant_block(
            codes_ptr,
            scales_ptr,
            mins_ptr,
            rows,
            row_mask,
            k0,
            row_bytes,
            n_groups,
            BITS,
            GROUP,
            HAS_MINS,
            BLOCK_N,
            BLOCK_K,
        )
        x_mask = (offs_t[:, None] < T) & in_k[None, :]
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :], mask=x_mask, other=0.0)
        acc += tl.reduce(x.to(tl.float32)[:, None, :] * w[None, :, :], 2, tl.standard._sum_combine)
    out_mask = (offs_t[:, None] < T) & (offs_n[None, :] < N)
    if SPLIT:
        partial = out_ptr + (pid_k * T + offs_t[:, None]) * N + offs_n[None, :]
        tl.store(partial, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        out = out_ptr + offs_t[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def splitk_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    numel,
    N,
    splits,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = sum over slices of partial[slice] (in slice order) + bias, in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for s in range(0, splits):
        acc += tl.load(partial_ptr + s * numel + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(
    configs=PREFILL_CONFIGS,
    key=["N", "K", "T_BUCKET", "FP32_DOT"],
    prune_configs_by={"early_config_prune": configs_for_group},
    cache_results=True,  # the choice per shape is kept on disk: tuned once per machine
)
@triton.jit
def gemm_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    T,
    N,
    K,
    stride_xt,
    row_bytes,
    n_groups,
    T_BUCKET,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    """out[T, N] = x[T, K] @ dequant(w)[N, K]^T + bias; T_BUCKET (T rounded up to a power
    of two) only keys the autotuner, so a new prefill length does not retune."""
    # Grouped program order: GROUP_M row blocks share each weight column block while it
    # is in L2.
    pid = tl.program_id(0)
    blocks_m = (T + BLOCK_M - 1) // BLOCK_M
    blocks_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n.to(tl.int64)[:, None]
    row_mask = rows < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # a: [BLOCK_M, BLOCK_K] in x's dtype (zero past K: padded codes count 0),
        # w: [BLOCK_K, BLOCK_N] dequantized into it
        a_mask = (offs_m[:, None] < T) & (offs_k[None, :] < K)
        a = tl.load(x_ptr + offs_m[:, None] * stride_xt + offs_k[None, :], mask=a_mask, other=0.0)
        w = _dequant_block(
            codes_ptr,
            scales_ptr,
            mins_ptr,
            rows,
            row_mask,
            k0,
            row_bytes,
            n_groups,
            BITS,
            GROUP,
            HAS_MINS,
            BLOCK_N,
            BLOCK_K,
        )
        w = tl.trans(w.to(a.dtype))
        # fp32 activations: three TF32 products per term (tf32x3), close to fp32 on the
        # tensor cores; plain TF32 drops 13 mantissa bits the torch reference keeps, and
        # IEEE dots run on the CUDA cores and spill registers at these tiles.
        acc = tl.dot(a, w, acc, input_precision="tf32x3") if FP32_DOT else tl.dot(a, w, acc)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(
        out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_n[None, :] < N)
    )
