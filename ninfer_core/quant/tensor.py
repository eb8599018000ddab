"""`QuantizedTensor`: a 2-D weight held as packed group codes and fp16 scales (and, in
an asymmetric format, fp16 group minimums).

The quantizer (the definition the tests' float64 oracles implement independently):

For a `[rows, cols]` weight and a symmetric format of `bits` and `group` (see
`formats.py`), pad each row with zeros to `padded_cols`, cut it into groups of `group`
columns, and per group, in float64:

    absmax = max |w|
    scale  = fp16(min(absmax / qmax, 65504))     # qmax = 7, 15, 31, 127 for 4/5/6/8 bits
    code   = clamp(round_half_even(w / scale), qmin, qmax)   if scale > 0, else 0

`fp16(.)` is one correctly rounded float64 -> fp16 conversion (round to nearest even).
Torch's own float64 -> fp16 cast rounds twice (through fp32) and misses by one ulp on
rare ties, so `_round_fp16` rounds to fp32 *to odd* first, which makes the second
rounding exact. An all-zero group, or one whose scale rounds to 0, has codes 0.

For an asymmetric format (`fmt.mins`; Q4G32M), per group of the row's real columns
(padding takes no part), in float64, with `umax = 2^bits - 1`:

    min    = fp16(clamp(min w, -65504, 65504))              # sign * fp16(|.|)
    scale  = fp16(clamp((max w - min) / umax, 0, 65504))
    u      = clamp(round_half_even((w - min) / scale), 0, umax)   if scale > 0, else 0

and the stored code is `u - 2^(bits-1)`; padded columns have `u = 0`.

For a code-book format (`fmt.book`: IQ4G32), per group, in float64, with `top` the
book's largest magnitude (127):

    scale  = fp16(min(absmax / top, 65504))
    u      = the index of the book value nearest w / scale (the lower on a tie)   if scale > 0

and an all-zero group takes the index of the value nearest 0; the stored 4-bit field is
`u` (as the code `u - 8`). `codes()` gives the values `book[u]`.

Dequantizing is `code * scale` in fp32 -- exact, since an 8-bit code times an 11-bit
fp16 significand fits fp32's 24 bits -- then one cast to the requested dtype. An
asymmetric format computes `u * scale + min` in fp32: the product is exact, the sum
rounds once (as ggml's own dequantizer does), then one cast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ninfer_core.errors import ArtifactError
from ninfer_core.quant.codes import pack_codes, unpack_codes
from ninfer_core.quant.formats import WeightFormat, weight_format

FP16_MAX = 65504.0
#: Elements of one dequantized chunk on the reference GEMM path (16 MB in fp32).
_CHUNK_ELEMS = 1 << 22


class QuantizedTensor:
    """`packed`: uint8 [rows, padded_cols * bits / 8] (the stored stream),
    `scales`: fp16 [rows, padded_cols / group], `mins`: fp16 like `scales` for an
    asymmetric format, else None; logical `shape` is `(rows, cols)`."""

    __slots__ = ("fmt", "mins", "packed", "scales", "shape")

    def __init__(
        self,
        fmt: WeightFormat,
        shape: tuple[int, int],
        packed: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None = None,
    ) -> None:
        rows, cols = int(shape[0]), int(shape[1])
        if not fmt.quantized:
            raise ValueError(f"{fmt.name} is a dense format, not a quantized one")
        padded = fmt.padded_cols(cols)
        want_codes = (rows, padded * fmt.bits // 8)
        want_scales = (rows, padded // fmt.group)
        if packed.dtype != torch.uint8 or tuple(packed.shape) != want_codes:
            raise ValueError(
                f"{fmt.name} {[rows, cols]}: codes must be uint8 {list(want_codes)}, "
                f"not {packed.dtype} {list(packed.shape)}"
            )
        if scales.dtype != torch.float16 or tuple(scales.shape) != want_scales:
            raise ValueError(
                f"{fmt.name} {[rows, cols]}: scales must be fp16 {list(want_scales)}, "
                f"not {scales.dtype} {list(scales.shape)}"
            )
        if fmt.mins and (
            mins is None or mins.dtype != torch.float16 or tuple(mins.shape) != want_scales
        ):
            found = "none" if mins is None else f"{mins.dtype} {list(mins.shape)}"
            raise ValueError(
                f"{fmt.name} {[rows, cols]}: mins must be fp16 {list(want_scales)}, not {found}"
            )
        if not fmt.mins and mins is not None:
            raise ValueError(f"{fmt.name} is symmetric: it has no mins")
        self.fmt, self.shape = fmt, (rows, cols)
        self.packed, self.scales, self.mins = packed, scales, mins

    # ------------------------------------------------------------------ storage

    @classmethod
    def from_stored(
        cls, fmt_name: str, shape: Sequence[int], data: torch.Tensor
    ) -> QuantizedTensor:
        """The tensor over `data` (1-D uint8, exactly `stored_nbytes`): codes block, then
        scales block, then (asymmetric formats) mins block. Zero-copy views where the
        scale block is 2-byte aligned in memory."""
        fmt = weight_format(fmt_name)
        shape = (int(shape[0]), int(shape[1])) if len(shape) == 2 else tuple(shape)
        need = fmt.stored_nbytes(shape)
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != need:
            raise ArtifactError(
                f"{fmt.name} tensor of shape {list(shape)} needs {need} bytes as 1-D uint8, "
                f"got {data.dtype} {list(data.shape)}"
            )
        rows, cols = shape
        padded = fmt.padded_cols(cols)
        code_bytes = fmt.code_bytes(shape)
        packed = data[:code_bytes].view(rows, padded * fmt.bits // 8)
        raw = data[code_bytes:]
        try:
            halves = raw.view(torch.float16)
        except RuntimeError:  # the scale block starts on an odd address: copy it
            halves = raw.clone().view(torch.float16)
        halves = halves.view(-1, rows, padded // fmt.group)  # [1 or 2, rows, groups]
        mins = halves[1] if fmt.mins else None
        return cls(fmt, shape, packed, halves[0], mins)

    def to_stored(self) -> torch.Tensor:
        """1-D uint8: the codes block, then the scales block, then (asymmetric formats)
        the mins block (both little-endian fp16)."""
        parts = [self.packed.contiguous().view(-1)]
        for half in (self.scales, self.mins):
            if half is not None:
                parts.append(half.contiguous().view(-1).view(torch.uint8))
        return torch.cat(parts)

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.numel() * 2
        return self.packed.numel() + self.scales.numel() * 2 + mins

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def padded_cols(self) -> int:
        return self.fmt.padded_cols(self.shape[1])

    def to(self, device: torch.device | str) -> QuantizedTensor:
        device = torch.device(device)
        if self.packed.device == device:
            return self
        mins = None if self.mins is None else self.mins.to(device)
        return QuantizedTensor(
            self.fmt, self.shape, self.packed.to(device), self.scales.to(device), mins
        )

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.fmt.name}, shape={list(self.shape)}, {self.nbytes} bytes)"

    # ------------------------------------------------------------------- values

    def codes(self) -> torch.Tensor:
        """int8 [rows, padded_cols]: the signed codes, padding included (for an
        asymmetric format the stored value minus 2^(bits-1); for a code-book format the
        values its indices name)."""
        codes = unpack_codes(self.packed, self.fmt.bits)
        if self.fmt.book is None:
            return codes
        book = torch.tensor(self.fmt.book, dtype=torch.int8, device=codes.device)
        return book[codes.long() - self.fmt.qmin]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, cols] in `dtype`: code * scale in fp32 (exact), or for an asymmetric
        format (code - qmin) * scale + min in fp32 (one rounding), then one cast."""
        rows, cols = self.shape
        g = self.fmt.group
        codes = self.codes().view(rows, -1, g).to(torch.float32)
        if self.mins is not None:
            codes -= self.fmt.qmin  # the stored value, 0 .. 2^bits - 1
        dense = codes * self.scales.to(torch.float32)[..., None]
        if self.mins is not None:
            dense += self.mins.to(torch.float32)[..., None]
        out = dense.view(rows, -1)[:, :cols].to(dtype)
        return out if out.is_contiguous() else out.contiguous()

    def narrow_rows(self, start: int, length: int) -> QuantizedTensor:
        """Rows `start:start + length`, as views."""
        return QuantizedTensor(
            self.fmt,
            (length, self.shape[1]),
            self.packed.narrow(0, start, length),
            self.scales.narrow(0, start, length),
            None if self.mins is None else self.mins.narrow(0, start, length),
        )

    def index_rows(self, ids: torch.Tensor) -> QuantizedTensor:
        """The rows `ids` (1-D), gathered (packed; nothing dequantized). A permutation
        of `range(rows)` reorders the rows (a GGUF reader undoing llama.cpp's q/k
        permutation does that)."""
        ids = ids.reshape(-1).to(self.device)
        return QuantizedTensor(
            self.fmt,
            (ids.numel(), self.shape[1]),
            self.packed.index_select(0, ids),
            self.scales.index_select(0, ids),
            None if self.mins is None else self.mins.index_select(0, ids),
        )

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ids: integer [...] -> [..., cols] in `dtype`; only the looked-up rows are
        dequantized (an embedding table never becomes dense)."""
        return self.index_rows(ids).dequantize(dtype).view(*ids.shape, self.shape[1])

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """The reference GEMM, x: [T, cols] -> [T, rows] in x.dtype: row chunks are
        dequantized into x.dtype and multiplied one by one, so no dense copy of the
        whole weight is ever resident."""
        rows = self.shape[0]
        step = max(1, _CHUNK_ELEMS // self.padded_cols)
        if step >= rows:
            return F.linear(x, self.dequantize(x.dtype), b)
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            part = self.narrow_rows(start, n).dequantize(x.dtype)
            bias = None if b is None else b[start : start + n]
            out[..., start : start + n] = F.linear(x, part, bias)
        return out

    @staticmethod
    def cat_rows(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
        """Stack row blocks of one format and one column count (fused q|k|v, gate|up)."""
        if not parts:
            raise ValueError("cat_rows needs at least one part")
        fmt, cols = parts[0].fmt, parts[0].shape[1]
        for p in parts[1:]:
            if p.fmt != fmt or p.shape[1] != cols:
                raise ValueError(
                    f"cannot stack {p.fmt.name} {list(p.shape)} under {fmt.name} "
                    f"with {cols} columns: one format and one width only"
                )
        if len(parts) == 1:
            return parts[0]
        rows = sum(p.shape[0] for p in parts)
        return QuantizedTensor(
            fmt,
            (rows, cols),
            torch.cat([p.packed for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]) if fmt.mins else None,
        )


# ----------------------------------------------------------------------- encoder


def _round_fp16(x: torch.Tensor) -> torch.Tensor:
    """float64 >= 0 -> fp16, correctly rounded (round to nearest even, once).

    Rounding to fp32 first would round twice; rounding to fp32 *to odd* (truncate, then
    set the last bit when anything was dropped) keeps enough information that the
    fp32 -> fp16 rounding lands where the direct one would.
    """
    f = x.to(torch.float32)
    over = f.to(torch.float64) > x  # rounded up: step back towards zero (x >= 0)
    f = torch.where(over, torch.nextafter(f, torch.zeros_like(f)), f)
    inexact = f.to(torch.float64) != x
    bits = f.view(torch.int32) | inexact.to(torch.int32)
    return bits.view(torch.float32).to(torch.float16)


def _encode_rows(w: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    # w: [r, cols] any float -> codes int8 [r, padded], scales fp16 [r, groups]
    rows, cols = w.shape
    padded, g = fmt.padded_cols(cols), fmt.group
    w64 = F.pad(w.to(device="cpu", dtype=torch.float64), (0, padded - cols))
    groups = w64.view(rows, padded // g, g)
    absmax = groups.abs().amax(-1)  # [r, groups]
    scales = _round_fp16((absmax / fmt.qmax).clamp(max=FP16_MAX))
    s64 = scales.to(torch.float64)[..., None]
    safe = torch.where(s64 > 0, s64, torch.ones_like(s64))
    codes = torch.round(groups / safe).clamp(fmt.qmin, fmt.qmax)  # round half to even
    codes = torch.where(s64 > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.int8).view(rows, padded), scales


def _encode_rows_asymmetric(
    w: torch.Tensor, fmt: WeightFormat
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # w: [r, cols] any float -> codes int8 [r, padded], scales and mins fp16 [r, groups]
    rows, cols = w.shape
    padded, g = fmt.padded_cols(cols), fmt.group
    umax = (1 << fmt.bits) - 1
    w64 = w.to(device="cpu", dtype=torch.float64)
    inf = float("inf")
    # min and max over the real columns: padding stands aside (+inf for min, -inf for max)
    lo = F.pad(w64, (0, padded - cols), value=inf).view(rows, -1, g).amin(-1)
    hi = F.pad(w64, (0, padded - cols), value=-inf).view(rows, -1, g).amax(-1)
    lo = lo.clamp(-FP16_MAX, FP16_MAX)
    mins = (_round_fp16(lo.abs()).to(torch.float64) * lo.sign()).to(torch.float16)
    m64 = mins.to(torch.float64)
    scales = _round_fp16(((hi - m64) / umax).clamp(0, FP16_MAX))
    s64, m64 = scales.to(torch.float64)[..., None], m64[..., None]
    safe = torch.where(s64 > 0, s64, torch.ones_like(s64))
    groups = F.pad(w64, (0, padded - cols)).view(rows, -1, g)
    u = torch.round((groups - m64) / safe).clamp(0, umax)  # round half to even
    u = torch.where(s64 > 0, u, torch.zeros_like(u)).view(rows, padded)
    u[:, cols:] = 0  # padded columns store 0
    return (u + fmt.qmin).to(torch.int8), scales, mins


def _encode_rows_book(w: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    # w: [r, cols] any float -> stored indices as codes (u - 8) int8 [r, padded], scales
    rows, cols = w.shape
    padded, g = fmt.padded_cols(cols), fmt.group
    book = torch.tensor(fmt.book, dtype=torch.float64)
    top = float(book.abs().max())
    w64 = F.pad(w.to(device="cpu", dtype=torch.float64), (0, padded - cols))
    groups = w64.view(rows, padded // g, g)
    scales = _round_fp16((groups.abs().amax(-1) / top).clamp(max=FP16_MAX))
    s64 = scales.to(torch.float64)[..., None]
    units = torch.where(s64 > 0, groups / torch.where(s64 > 0, s64, 1.0), 0.0)
    # the nearest value: midpoints between neighbours, a tie going to the lower one
    u = torch.bucketize(units, (book[:-1] + book[1:]) / 2)
    return (u + fmt.qmin).to(torch.int8).view(rows, padded), scales


def quantize(w: torch.Tensor, fmt_name: str) -> QuantizedTensor:
    """w: float [rows, cols] (bf16, fp16 or fp32, any device) -> the format's codes and
    scales (and mins), computed in float64 on the CPU a row chunk at a time; result on
    the CPU."""
    fmt = weight_format(fmt_name)
    if not fmt.quantized:
        raise ValueError(f"{fmt.name} is a dense format; quantize() makes quantized ones")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{fmt.name} quantizes a 2-D float matrix, not {w.dtype} {list(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"cannot quantize a matrix with inf or NaN values to {fmt.name}")
    rows, cols = w.shape
    padded = fmt.padded_cols(cols)
    packed = torch.empty(rows, padded * fmt.bits // 8, dtype=torch.uint8)
    scales = torch.empty(rows, padded // fmt.group, dtype=torch.float16)
    mins = torch.empty_like(scales) if fmt.mins else None
    step = max(1, _CHUNK_ELEMS // padded)
    for start in range(0, rows, step):
        end = min(rows, start + step)
        if mins is not None:
            codes, s, mins[start:end] = _encode_rows_asymmetric(w[start:end], fmt)
        elif fmt.book is not None:
            codes, s = _encode_rows_book(w[start:end], fmt)
        else:
            codes, s = _encode_rows(w[start:end], fmt)
        packed[start:end] = pack_codes(codes, fmt.bits)
        scales[start:end] = s
    return QuantizedTensor(fmt, (rows, cols), packed, scales, mins)
