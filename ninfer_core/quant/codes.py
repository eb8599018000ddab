"""Bit packing of signed group codes into the stored code stream (see `formats.py`).

Each row is a little-endian bit stream: code `i` occupies bits `[i*bits, (i+1)*bits)`,
stored offset-binary (`code + 2^(bits-1)`). Because a row's padded length is a multiple
of 8 codes, every run of 8 codes fills exactly `bits` whole bytes, so packing works on
`[rows, n/8, 8]` blocks: the 8 codes of a block become one `8*bits`-bit integer (at most
48 bits for 6-bit codes, held in int64) that is cut into `bits` bytes. 4 and 8 bits take
shortcuts (nibbles; one byte per code) with the same result.

All of it is vectorised torch; large matrices go through in row chunks so the int64
temporaries stay small.
"""

from __future__ import annotations

import torch

#: Codes per chunk when packing or unpacking through int64 temporaries (8 bytes each).
_CHUNK_CODES = 1 << 22


def _row_chunks(rows: int, per_row: int):
    step = max(1, _CHUNK_CODES // max(per_row, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: integer [rows, n] in [-2^(bits-1), 2^(bits-1) - 1], n a multiple of 8
    -> uint8 [rows, n * bits / 8], the stored stream."""
    rows, n = codes.shape
    if n % 8:
        raise ValueError(f"a packed row holds a multiple of 8 codes, not {n}")
    offset = 1 << (bits - 1)
    if bits == 8:
        return (codes.to(torch.int16) + offset).to(torch.uint8)
    if bits == 4:
        u = (codes.to(torch.int16) + offset).to(torch.uint8).view(rows, n // 2, 2)
        return u[..., 0] | (u[..., 1] << 4)  # low nibble first
    out = torch.empty(rows, n * bits // 8, dtype=torch.uint8, device=codes.device)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    cuts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    for start, end in _row_chunks(rows, n):
        u = (codes[start:end].to(torch.int64) + offset).view(end - start, n // 8, 8)
        block = (u << shifts).sum(-1)  # [r, n/8]: one 8*bits-bit integer per 8 codes
        raw = (block[..., None] >> cuts) & 0xFF  # [r, n/8, bits], least significant first
        out[start:end] = raw.to(torch.uint8).view(end - start, -1)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed: uint8 [rows, n * bits / 8] -> int8 [rows, n], the signed codes."""
    rows, nbytes = packed.shape
    n = nbytes * 8 // bits
    offset = 1 << (bits - 1)
    if bits == 8:
        return (packed ^ 0x80).view(torch.int8)  # offset-binary -> two's complement
    if bits == 4:
        lo, hi = packed & 0x0F, packed >> 4
        return (torch.stack((lo, hi), dim=-1).view(rows, n).view(torch.int8)) - offset
    out = torch.empty(rows, n, dtype=torch.int8, device=packed.device)
    cuts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    mask = (1 << bits) - 1
    for start, end in _row_chunks(rows, n):
        raw = packed[start:end].to(torch.int64).view(end - start, n // 8, bits)
        block = (raw << cuts).sum(-1)  # [r, n/8]
        u = (block[..., None] >> shifts) & mask  # [r, n/8, 8]
        out[start:end] = (u - offset).to(torch.int8).view(end - start, n)
    return out
