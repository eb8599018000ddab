"""The Triton backend's `linear`: fused dequantize + GEMM over NInfer's group-code weights.

A quantized weight stays in its stored layout (`ninfer_core.quant.formats`): per row a
little-endian bit stream of offset-binary codes, one fp16 scale (and, for Q4G32M, one
fp16 min) per group. The kernels read those bytes and dequantize in registers, so a
weight costs on the GPU exactly what it costs on disk and never exists dense. The
kernels themselves are in `linear_kernels.py`; this module packs, chooses and launches.

Two kernels, chosen by the number of activation rows T:

- decode (T <= `DECODE_MAX_ROWS`): a GEMV. Each program owns `BLOCK_N` output rows and
  one K slice, dequantizes `[BLOCK_N, BLOCK_K]` codes into fp32 and multiplies them with
  the T activation rows on the CUDA cores (a decode step is bound by reading the codes,
  not by arithmetic). When there are too few row blocks to fill the GPU, K is split:
  each slice writes fp32 partials and a second small kernel sums them in a fixed order
  and adds the bias. Plain stores rather than `atomic_add` keep results bit-identical
  from run to run and let the autotuner rerun a launch without zeroing anything.
- prefill (T larger): a tiled tensor-core GEMM. `[BLOCK_M, BLOCK_K]` activations and a
  `[BLOCK_K, BLOCK_N]` weight tile dequantized into the activation dtype feed `tl.dot`
  with an fp32 accumulator. fp32 activations multiply as tf32x3 (close to fp32, not
  TF32's 10-bit mantissa), as the torch reference keeps fp32.

Dense weights go to `torch.nn.functional.linear`: cuBLAS is already at the roofline for
them, and a Triton copy of it would only add autotuning time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_plugins.backend_triton.linear_kernels import (
    DECODE_CONFIGS,
    INTERPRETED,
    PREFILL_CONFIGS,
    gemm_kernel,
    gemv_kernel,
    splitk_reduce_kernel,
)
from ninfer_plugins.backend_triton.table import DEQUANTIZED_FORMATS, LINEAR_FORMATS

__all__ = [
    "DECODE_CONFIGS",
    "DECODE_MAX_ROWS",
    "PREFILL_CONFIGS",
    "TritonQuantWeight",
    "linear",
    "pack_linear",
    "packed_nbytes",
]

#: Row counts up to this run the GEMV kernel; more run the tensor-core GEMM (whose
#: smallest M tile, 16, would mostly multiply padding below it).
DECODE_MAX_ROWS = 8
#: The GEMV splits K until about this many programs run (a few waves on an H100's 132
#: SMs); slices are multiples of `_SPLIT_QUANTUM` so every BLOCK_K divides them.
_TARGET_PROGRAMS = 512
_SPLIT_QUANTUM = 256
#: Row block the split heuristic assumes; the autotuner may pick another BLOCK_N.
_SPLIT_BLOCK_N = 32
_REDUCE_BLOCK = 256
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: K slice under the interpreter: two of its BLOCK_K steps, so a small test matrix
#: exercises both the split path and several steps within a slice.
INTERPRET_K_PER_SPLIT = 64


@dataclass(frozen=True, slots=True)
class TritonQuantWeight:
    """A quantized `[out, in]` weight as the kernels read it: the stored layout, on the
    weight's device. `codes`: uint8 `[out, padded_in * bits / 8]`; `scales` (and `mins`
    for an asymmetric format): fp16 `[out, padded_in / group]`."""

    fmt_name: str
    shape: tuple[int, int]
    bits: int
    group: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.numel() * 2
        return self.codes.numel() + self.scales.numel() * 2 + mins

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @classmethod
    def from_quantized(cls, q: QuantizedTensor) -> TritonQuantWeight:
        if q.fmt.name not in LINEAR_FORMATS:
            known = ", ".join(sorted(LINEAR_FORMATS))
            raise ValueError(f"no Triton GEMM for {q.fmt.name} weights (reads {known})")
        mins = None if q.mins is None else q.mins.contiguous()
        return cls(
            q.fmt.name,
            q.shape,
            q.fmt.bits,
            q.fmt.group,
            q.packed.contiguous(),
            q.scales.contiguous(),
            mins,
        )


def pack_linear(w, *, dtype: torch.dtype | None = None):
    """A `QuantizedTensor` becomes a `TritonQuantWeight` over the same tensors (no copy
    where they are contiguous: the kernels read the stored layout, whatever `dtype` the
    activations have), or, in a format no kernel reads (`DEQUANTIZED_FORMATS`), a dense
    matrix of `dtype`, once. A dense weight is kept as it is, for `F.linear`."""
    if isinstance(w, QuantizedTensor):
        if w.fmt.name in DEQUANTIZED_FORMATS:
            return w.dequantize(dtype or torch.float32)
        return TritonQuantWeight.from_quantized(w)
    return w


def packed_nbytes(fmt_name: str, shape: tuple[int, int], *, dtype) -> int | None:
    """Bytes `pack_linear` holds for a `shape` weight stored as `fmt_name`: the stored
    size for a format the kernels read, the dense size in `dtype` for one dequantized at
    load, None for a dense one (kept as loaded)."""
    fmt = weight_format(fmt_name)
    if not fmt.quantized:
        return None
    if fmt_name in DEQUANTIZED_FORMATS:
        return int(shape[0]) * int(shape[1]) * (dtype or torch.float32).itemsize
    return fmt.stored_nbytes(tuple(shape))


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in] -> [..., out] in x.dtype, for a dense weight (cuBLAS, via `F.linear`)
    or a quantized one (the GEMV kernel up to `DECODE_MAX_ROWS` rows, else the GEMM)."""
    if isinstance(w, QuantizedTensor):
        if w.fmt.name in DEQUANTIZED_FORMATS:
            return w.linear(x, b)  # not packed: the reference path
        w = TritonQuantWeight.from_quantized(w)
    if not isinstance(w, TritonQuantWeight):
        return F.linear(x, w, b)
    out_features, in_features = w.shape
    if x.dtype not in _ACTIVATION_DTYPES:
        raise TypeError(f"no Triton GEMM for {x.dtype} activations (fp16, bf16 or fp32)")
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the {w.fmt_name} weight {in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if b is not None:
        b = b.contiguous()
        assert b.shape == (out_features,), f"bias {list(b.shape)} for {out_features} outputs"
    assert w.codes.is_contiguous() and w.scales.is_contiguous()
    assert w.mins is None or w.mins.is_contiguous()
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        if x2.shape[0] <= DECODE_MAX_ROWS:
            _decode(x2, w, b, out)
        else:
            _prefill(x2, w, b, out)
    return out.view(*lead, out_features)


def _format_args(w: TritonQuantWeight) -> dict:
    return {
        "BITS": w.bits,
        "GROUP": w.group,
        "HAS_MINS": w.mins is not None,
    }


def _decode_slice_len(out_features: int, in_features: int) -> int:
    """K slice length for the GEMV: the whole row when the row blocks alone fill the GPU,
    else short enough that blocks x slices reaches `_TARGET_PROGRAMS`."""
    row_blocks = triton.cdiv(out_features, _SPLIT_BLOCK_N)
    slices = max(1, min(_TARGET_PROGRAMS // row_blocks, triton.cdiv(in_features, _SPLIT_QUANTUM)))
    per_slice = triton.cdiv(triton.cdiv(in_features, slices), _SPLIT_QUANTUM) * _SPLIT_QUANTUM
    return per_slice


def _decode(
    x: torch.Tensor, w: TritonQuantWeight, b: torch.Tensor | None, out: torch.Tensor
) -> None:
    # x: [T, K] (T <= DECODE_MAX_ROWS), out: [T, N]
    t, k = x.shape
    n = w.shape[0]
    k_per_split = INTERPRET_K_PER_SPLIT if INTERPRETED else _decode_slice_len(n, k)
    # slices start on K blocks (BLOCK_K <= 64), so every K block lies inside a group
    assert k_per_split % 64 == 0
    splits = triton.cdiv(k, k_per_split)
    split = splits > 1
    target = torch.empty(splits, t, n, dtype=torch.float32, device=x.device) if split else out
    mins = w.mins if w.mins is not None else w.scales  # never read without HAS_MINS
    bias = b if b is not None else out  # never read without HAS_BIAS

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), splits)

    gemv_kernel[grid](
        x,
        w.codes,
        w.scales,
        mins,
        bias,
        target,
        t,
        n,
        k,
        x.stride(0),
        w.codes.shape[1],
        w.scales.shape[1],
        k_per_split,
        HAS_BIAS=b is not None and not split,
        SPLIT=split,
        BLOCK_T=triton.next_power_of_2(t),
        **_format_args(w),
    )
    if split:
        numel = t * n
        splitk_reduce_kernel[(triton.cdiv(numel, _REDUCE_BLOCK),)](
            target,
            bias,
            out,
            numel,
            n,
            splits,
            HAS_BIAS=b is not None,
            BLOCK=_REDUCE_BLOCK,
        )


def _prefill(
    x: torch.Tensor, w: TritonQuantWeight, b: torch.Tensor | None, out: torch.Tensor
) -> None:
    # x: [T, K] (T > DECODE_MAX_ROWS), out: [T, N]
    t, k = x.shape
    n = w.shape[0]
    mins = w.mins if w.mins is not None else w.scales  # never read without HAS_MINS
    bias = b if b is not None else out  # never read without HAS_BIAS

    def grid(meta):
        return (triton.cdiv(t, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    gemm_kernel[grid](
        x,
        w.codes,
        w.scales,
        mins,
        bias,
        out,
        t,
        n,
        k,
        x.stride(0),
        w.codes.shape[1],
        w.scales.shape[1],
        triton.next_power_of_2(t),
        HAS_BIAS=b is not None,
        FP32_DOT=x.dtype == torch.float32,
        **_format_args(w),
    )
