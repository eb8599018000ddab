"""`linear` for the CuPy backend: launches `kernels_cuda.py`'s kernels on torch's stream.

Tensors stay torch's: each is handed to CuPy through DLPack (`cupy.from_dlpack`, no
copy; bf16 as int16, which CuPy has no dtype for) and every launch goes on torch's
current stream (`cupy.cuda.ExternalStream`), so the kernels order with torch's own
work without a synchronisation. The module is compiled once per process and device.

Up to `GEMV_MAX_ROWS` activation rows (decode, a speculative round) run the GEMV
kernel, which reads every packed weight once; more rows (prefill) dequantize the
weight `TILE_ELEMS` at a time into the activations' dtype and call `F.linear`
(cuBLAS), so no dense copy of the whole weight stays resident.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_plugins.backend_cupy import kernels_cuda, table

GEMV_MAX_ROWS = kernels_cuda.GEMV_MAX_ROWS
#: Elements of one dequantized tile on the prefill path (32 MiB in fp16).
TILE_ELEMS = 1 << 24
#: Base alignment the kernels' word loads need.
ALIGN = 16
_ACTIVATION = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


class CupyWeight:
    """A quantized weight as the kernels read it: the `QuantizedTensor`'s codes, scales
    and mins on the GPU (contiguous, 16-byte aligned), as stored."""

    __slots__ = ("bits", "q")

    def __init__(self, q: QuantizedTensor) -> None:
        self.q = q
        self.bits = q.fmt.bits

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __repr__(self) -> str:
        return f"CupyWeight({self.q.fmt.name}, shape={list(self.q.shape)})"


def readable(q: QuantizedTensor) -> bool:
    """Whether the kernels read `q`'s format."""
    return q.fmt.name in table.LINEAR_FORMATS


def pack_linear(w: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """A quantized weight of a format the kernels read becomes a `CupyWeight` on
    `device`; one of `table.DEQUANTIZED_FORMATS` a dense matrix of `dtype`, once; anything
    else is kept as it is (`linear` then runs the reference)."""
    if isinstance(w, QuantizedTensor) and w.fmt.name in table.DEQUANTIZED_FORMATS:
        return w.dequantize(dtype or torch.float32).to(device)
    if not isinstance(w, QuantizedTensor) or not readable(w):
        return w
    parts = [_placed(t, device) for t in (w.packed, w.scales, w.mins) if t is not None]
    mins = parts[2] if len(parts) == 3 else None
    return CupyWeight(QuantizedTensor(w.fmt, w.shape, parts[0], parts[1], mins))


def _placed(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = t.to(device)
    if not t.is_contiguous() or t.data_ptr() % ALIGN:
        t = t.clone(memory_format=torch.contiguous_format)  # torch's allocator aligns
    return t


def packed_nbytes(
    fmt_name: str, shape: tuple[int, int], dtype: torch.dtype | None = None
) -> int | None:
    """Bytes `pack_linear` holds: the stored bytes for a format the kernels read (the
    codes are used as stored), the dense size in `dtype` for one dequantized at load,
    else None (kept as loaded)."""
    if fmt_name in table.DEQUANTIZED_FORMATS:
        return int(shape[0]) * int(shape[1]) * (dtype or torch.float32).itemsize
    fmt = weight_format(fmt_name)
    if not fmt.quantized or fmt.name not in table.LINEAR_FORMATS:
        return None
    return fmt.stored_nbytes(shape)


def linear(x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in] -> [..., out] in x.dtype (the `KernelOps.linear` contract)."""
    if isinstance(w, QuantizedTensor):
        if not (readable(w) and x.is_cuda and x.dtype in _ACTIVATION):
            return w.linear(x, b)  # the reference: a format or device these kernels lack
        w = pack_linear(w, x.device)
    if not isinstance(w, CupyWeight):
        return F.linear(x, w, b)
    if not (x.is_cuda and x.dtype in _ACTIVATION):
        return w.q.linear(x, b)  # the reference: activations the kernels do not take
    rows, cols = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty(*lead, rows)
    if b is not None:
        assert b.shape == (rows,), (tuple(b.shape), rows)
        b = b.to(x.dtype).contiguous()  # no copy when it already is
    # decode rows read the codes in place; a prefill chunk goes through cuBLAS
    out = _gemv(x2, w, b) if x2.shape[0] <= GEMV_MAX_ROWS else _tiled_gemm(x2, w, b)
    return out.view(*lead, rows)


def _gemv(x: torch.Tensor, w: CupyWeight, b: torch.Tensor | None) -> torch.Tensor:
    # x: [T, cols] contiguous, T <= GEMV_MAX_ROWS -> [T, rows]
    q = w.q
    rows, cols = q.shape
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    kernel = _kernel(x.device, "gemv", q, x.dtype)
    warps = kernels_cuda.WARPS
    grid = -(-rows // warps)
    with _on_torch_stream(x.device) as cp:
        args = (
            *_weight_args(cp, q),
            _dl(cp, x),
            _dl(cp, out),
            _dl(cp, b if b is not None else x),  # a dummy pointer when there is no bias
            *_ints(rows, cols, x.shape[0], q.fmt.group, int(b is not None)),
        )
        kernel((grid,), (warps * 32,), args)
    return out


def _tiled_gemm(x: torch.Tensor, w: CupyWeight, b: torch.Tensor | None) -> torch.Tensor:
    # x: [T, cols] -> [T, rows]: dequantize row tiles, multiply each with cuBLAS
    q = w.q
    rows, cols = q.shape
    step = min(rows, max(1, TILE_ELEMS // max(cols, 1)))
    tile = torch.empty(step, cols, dtype=x.dtype, device=x.device)
    if step == rows:
        _dequantize_into(tile, q)
        return F.linear(x, tile, b)
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        part = tile[:n]
        _dequantize_into(part, q.narrow_rows(start, n))
        bias = None if b is None else b[start : start + n]
        out[:, start : start + n] = F.linear(x, part, bias)  # same stream: tile reuse is safe
    return out


def dequantize(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, cols] in `dtype` on q's (CUDA) device, by the dequantize kernel."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _dequantize_into(out, q)
    return out


def _dequantize_into(out: torch.Tensor, q: QuantizedTensor) -> None:
    rows, cols = q.shape
    assert out.shape == (rows, cols) and out.is_contiguous(), (out.shape, q.shape)
    kernel = _kernel(out.device, "dequant", q, out.dtype)
    threads = kernels_cuda.DEQUANT_THREADS
    chunks = q.fmt.padded_cols(cols) // 8
    grid = -(-(rows * chunks) // threads)
    with _on_torch_stream(out.device) as cp:
        args = (*_weight_args(cp, q), _dl(cp, out), *_ints(rows, cols, q.fmt.group))
        kernel((grid,), (threads,), args)


def _weight_args(cp: Any, q: QuantizedTensor) -> tuple[Any, Any, Any]:
    """(codes, scales, mins) as CuPy arrays; the scales stand in for absent mins."""
    packed, scales = q.packed, q.scales
    # strides: whole rows, back to back, as the kernels index them
    assert packed.stride() == (packed.shape[1], 1) and scales.stride() == (scales.shape[1], 1)
    assert packed.data_ptr() % ALIGN == 0, "codes must start 16-byte aligned (pack_linear)"
    mins = q.mins if q.mins is not None else scales
    assert mins.stride() == scales.stride()
    return _dl(cp, packed), _dl(cp, scales), _dl(cp, mins)


def _ints(*values: int) -> tuple[Any, ...]:
    import numpy as np

    return tuple(np.int32(v) for v in values)


def _dl(cp: Any, t: torch.Tensor) -> Any:
    """`t` as a CuPy array over the same memory (bf16 seen as int16: CuPy has no bf16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cp.from_dlpack(t)


class _on_torch_stream:
    """`with _on_torch_stream(device) as cupy:` CuPy's device and current stream set to
    torch's, for DLPack exchanges and launches."""

    def __init__(self, device: torch.device) -> None:
        import cupy

        self.cupy = cupy
        index = _index(device)
        self.device = cupy.cuda.Device(index)
        self.stream = _external_stream(index, torch.cuda.current_stream(index).cuda_stream)

    def __enter__(self) -> Any:
        self.device.__enter__()
        self.stream.__enter__()
        return self.cupy

    def __exit__(self, *exc: object) -> None:
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _external_stream(index: int, pointer: int) -> Any:
    import cupy

    with cupy.cuda.Device(index):
        return cupy.cuda.ExternalStream(pointer)


@functools.cache
def _module(index: int) -> Any:
    """The compiled module for device `index` (NVRTC, once per process and device)."""
    import cupy

    with cupy.cuda.Device(index):
        module = cupy.RawModule(code=kernels_cuda.SOURCE, options=kernels_cuda.OPTIONS)
        module.compile()
        return module


@functools.cache
def _function(index: int, name: str) -> Any:
    import cupy

    with cupy.cuda.Device(index):
        return _module(index).get_function(name)


def _kernel(device: torch.device, op: str, q: QuantizedTensor, dtype: torch.dtype) -> Any:
    if dtype not in _ACTIVATION:
        raise TypeError(f"no CuPy kernel for {dtype} activations (fp16, bf16, fp32)")
    bits, mins = table.LINEAR_FORMATS[q.fmt.name]
    return _function(_index(device), kernels_cuda.kernel_name(op, bits, mins, _ACTIVATION[dtype]))
