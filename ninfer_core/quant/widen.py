"""Codes of several formats held in one format, the same values: for a fused group.

The dense family runs q|k|v and gate|up as one matrix, which holds one format. A file
may store the parts in different ones: llama.cpp's Q4_K_M writes `attn_v` in Q6_K beside
Q4_K q and k in some layers, and older mixes put a Q8_0 v beside Q4_0 q and k. Loading
such a group dense costs 16 bits a weight in bf16. Instead the group is held in the
narrowest format that holds every part exactly (`common_format`): the fewest bits of 4,
5, 6 and 8 that no part exceeds (4 for ggml's Q2_K and Q3_K beside Q4_K, 6 for Q4_K
beside Q6_K) for which the format exists; the narrowest group among the parts; mins
where a part has them. Each part goes over (`widen`) as:

    symmetric part,  w = c * d          ->  the same code and scale
    asymmetric part, w = u * d + m      ->  the same stored u, scale and min
    symmetric part into an asymmetric format: stored u = c + 2^(b-1), min = -2^(b-1) * d

with `b` the width of the part's codes (`u` is the stored value `c - qmin`; a code of
fewer bits than the format's is the same integer; a code book's codes are its 8-bit
values, `code_bits`). The last min is `d` times a power of two, exact in
fp16 unless it overflows, which fails with the reason. Scales and mins of a wider group
are repeated over the narrower groups it covers. Nothing is re-quantized.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ninfer_core.quant.codes import pack_codes
from ninfer_core.quant.formats import FORMATS, WeightFormat
from ninfer_core.quant.tensor import QuantizedTensor


def common_format(formats: Iterable[WeightFormat]) -> WeightFormat | None:
    """The narrowest format that holds every one of `formats` exactly (`Q4G16`, `Q4G16M`,
    `Q4G32`, `Q4G32M`, `Q5G32`, `Q5G32M`, `Q6G16`, `Q6G16M`, `W8G32`, `W8G16`, `W8G32M`,
    `W8G16M`); None where there is none (a part wider than 8 bits, or groups no such
    format divides)."""
    formats = list(formats)
    if not formats or not all(f.quantized and f.code_bits <= 8 for f in formats):
        return None
    group = min(f.group for f in formats)
    if any(f.group % group for f in formats):
        return None
    widest = max(f.code_bits for f in formats)  # a code book's values take 8 bits
    mins = "M" if any(f.mins for f in formats) else ""
    names = [f"Q{b}G{group}{mins}" for b in (4, 5, 6) if b >= widest] + [f"W8G{group}{mins}"]
    return next((FORMATS[n] for n in names if n in FORMATS), None)


def widen(q: QuantizedTensor, fmt: WeightFormat) -> QuantizedTensor:
    """`q` held in `fmt` (as `common_format` gives it): the same values."""
    if q.fmt == fmt:
        return q
    if (
        fmt.book is not None
        or fmt.bits < q.fmt.code_bits
        or q.fmt.group % fmt.group
        or (q.fmt.mins and not fmt.mins)
    ):
        raise ValueError(f"{q.fmt.name} codes do not fit {fmt.name} exactly")
    rows, cols = q.shape
    padded = fmt.padded_cols(cols)  # no wider than q's: the rest is q's padding
    groups = padded // fmt.group
    repeat = q.fmt.group // fmt.group

    def per_group(values: torch.Tensor) -> torch.Tensor:
        return values.repeat_interleave(repeat, dim=1)[:, :groups].contiguous()

    codes = q.codes()[:, :padded].to(torch.int16)  # signed codes
    scales = per_group(q.scales)
    mins = None
    if fmt.mins:
        qmin = -(1 << (q.fmt.code_bits - 1))  # of q's codes: a code book's are 8-bit
        codes = codes - qmin + fmt.qmin  # q's stored value, as a code of `fmt`
        if q.fmt.mins:
            mins = per_group(q.mins)
        else:  # c * d = u * d - 2^(b-1) * d
            mins = (scales.to(torch.float32) * float(qmin)).to(torch.float16)
            if not torch.isfinite(mins).all():
                raise ValueError(
                    f"{q.fmt.name} into {fmt.name}: a min of {qmin} x scale is beyond fp16's range"
                )
    return QuantizedTensor(fmt, (rows, cols), pack_codes(codes, fmt.bits), scales, mins)
