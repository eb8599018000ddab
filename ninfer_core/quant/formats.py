"""The weight formats a `.ninfer` file may store, and how many bytes each takes.

Dense formats store the tensor as it is (little-endian, row-major). Quantized formats
are group codes over the last dimension of a 2-D `[rows, cols]` tensor: each row is cut
into groups of `group` columns (the last group zero-padded when `cols` is not a
multiple), each group has one fp16 scale and, in an asymmetric format (`mins`), one fp16
minimum too:

    symmetric:   weight ≈ code * scale,                code in [-2^(bits-1), 2^(bits-1) - 1]
    asymmetric:  weight ≈ (code + 2^(bits-1)) * scale + min

so `code + 2^(bits-1)`, the stored value, runs over 0 .. 2^bits - 1 in both. Q4G32 and
W8G32 are ggml's Q4_0 and Q8_0; Q4G32M is ggml's Q4_1 (and holds its Q4_K); Q5G32 and
Q5G32M are its Q5_0 and Q5_1 (Q5G32M holds its Q5_K too); Q6G16 holds its Q6_K codes,
Q3G16 its Q3_K and Q2G16M its Q2_K; the other W8 formats, Q4G16, Q4G16M and Q6G16M hold a
fused group whose parts differ in type (see `ggml.py` and `widen.py`).

A code-book format (`book`: IQ4G32, ggml's IQ4_NL and IQ4_XS) stores 4-bit indices `u`
(0 .. 15) into a fixed table of sixteen integers instead of codes:

    weight = book[u] * scale

Its codes, as `QuantizedTensor.codes` gives them, are the values `book[u]` (-127 .. 113):
8-bit codes (`code_bits`), so it widens into an 8-bit format exactly.

The stored object is the code block, then the scale block, then (asymmetric formats
only) the min block:

- codes: rows × padded_cols codes, row-major, each row a little-endian bit stream in
  which code `i` occupies bits `[i*bits, (i+1)*bits)`, stored offset-binary
  (`code + 2^(bits-1)`, so 0 .. 2^bits - 1). For 8 bits that is one byte per code;
  for 4 bits two codes per byte, low nibble first.
- scales: rows × groups fp16 values, row-major, little-endian.
- mins: rows × groups fp16 values, row-major, little-endian (asymmetric formats only).

`padded_cols` is `cols` rounded up to the group; every block's size is whole bytes
because every group size here is a multiple of 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_core.errors import UnknownNameError


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """One storage format: a dense dtype, or `bits`-bit codes with a scale per `group`
    (and, with `mins`, an fp16 minimum per group as well)."""

    name: str
    bits: int
    group: int = 0  # 0: dense
    dtype: torch.dtype | None = None  # dense formats only
    mins: bool = False  # asymmetric: weight = (code - qmin) * scale + min
    book: tuple[int, ...] | None = None  # code-book values a 4-bit index names

    @property
    def quantized(self) -> bool:
        return self.group > 0

    @property
    def code_bits(self) -> int:
        """The width of the codes this format's values take: `bits`, or 8 for a code
        book (its values run over -127 .. 113)."""
        return 8 if self.book is not None else self.bits

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight when no group is padded: codes, scales and mins."""
        if not self.quantized:
            return float(self.bits)
        return self.bits + 16 * (2 if self.mins else 1) / self.group

    def padded_cols(self, cols: int) -> int:
        return -(-cols // self.group) * self.group

    def code_bytes(self, shape: tuple[int, ...]) -> int:
        rows, cols = _matrix(self, shape)
        return rows * self.padded_cols(cols) * self.bits // 8

    def scale_bytes(self, shape: tuple[int, ...]) -> int:
        rows, cols = _matrix(self, shape)
        return rows * (self.padded_cols(cols) // self.group) * 2

    def min_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the min block: as many as the scale block, or 0 (symmetric)."""
        return self.scale_bytes(shape) if self.mins else 0

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of one stored tensor of this format and logical `shape`."""
        if not self.quantized:
            numel = 1
            for d in shape:
                numel *= int(d)
            return numel * self.bits // 8
        return self.code_bytes(shape) + self.scale_bytes(shape) + self.min_bytes(shape)


def _matrix(fmt: WeightFormat, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"{fmt.name} stores 2-D [rows, cols] tensors, not shape {list(shape)}")
    return int(shape[0]), int(shape[1])


#: IQ4_NL's and IQ4_XS's code book (ggml's `kvalues_iq4nl`): the weight each 4-bit index
#: names, in units of the scale.
IQ4_BOOK = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("fp32", 32, dtype=torch.float32),
        WeightFormat("fp16", 16, dtype=torch.float16),
        WeightFormat("bf16", 16, dtype=torch.bfloat16),
        WeightFormat("Q4G64", 4, 64),
        WeightFormat("Q5G64", 5, 64),
        WeightFormat("Q6G64", 6, 64),
        WeightFormat("W8G32", 8, 32),
        WeightFormat("W8G16", 8, 16),
        WeightFormat("W8G32M", 8, 32, mins=True),
        WeightFormat("W8G16M", 8, 16, mins=True),
        WeightFormat("Q4G32", 4, 32),
        WeightFormat("Q4G32M", 4, 32, mins=True),
        WeightFormat("Q3G16", 3, 16),
        WeightFormat("Q2G16M", 2, 16, mins=True),
        WeightFormat("Q4G16", 4, 16),
        WeightFormat("Q4G16M", 4, 16, mins=True),
        WeightFormat("Q5G32", 5, 32),
        WeightFormat("Q5G32M", 5, 32, mins=True),
        WeightFormat("Q6G16", 6, 16),
        WeightFormat("Q6G16M", 6, 16, mins=True),
        WeightFormat("IQ4G32", 4, 32, book=IQ4_BOOK),
    )
}


def weight_format(name: str) -> WeightFormat:
    """The format called `name`; an unknown name lists the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownNameError("weight format", name, FORMATS) from None
