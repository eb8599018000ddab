"""Symmetric group quantizers for KV head vectors: int8, int4 (two per byte), fp8 e4m3.

Each group of `group` consecutive values of a head vector shares one fp16 scale,
`scale = fp16(fp32(amax) / qmax)`, and a value is stored as a code of `x / scale`.
The scale is rounded to fp16 *before* the values are divided by it, so encoder and
decoder use the very same scale. Because the scale has 11 significant bits and the
codes at most 8, `x / scale` in fp32 rounds to the same code as the exact quotient
would, and `code * scale` is exact in fp32: a float64 oracle of the same recipe
reproduces the codes bit for bit (the conformance test checks that).

Codes are uint8 or int8 tensors of shape `[..., code_width(D)]`, scales fp16
`[..., D // group]`; they index like the head vectors they came from, so paged pools
can hold them beside each other.
"""

from __future__ import annotations

import math

import torch

#: Elements of a head vector that share one scale, where the head dim allows it.
GROUP = 64
#: Smallest positive fp16 (a subnormal): the scale of an all-zero group, so 0/scale is 0.
SCALE_MIN = 2.0**-24
#: Largest finite fp16: a larger scale would decode as inf.
SCALE_MAX = 65504.0


def group_size(head_dim: int) -> int:
    """64, or the largest power of two dividing a head dim that 64 does not divide.

    Head dims of real models (64, 128, 256) get 64; the tiny test models (16) and odd
    sizes like 80 or 96 still get whole groups that never straddle two heads.
    """
    return math.gcd(GROUP, head_dim)


class GroupQuantizer:
    """Shared recipe: per-group absmax scale; subclasses map `x / scale` to codes."""

    name: str
    #: The code magnitude amax maps to.
    qmax: float
    #: Head-vector values per stored byte.
    values_per_byte: int = 1

    def code_width(self, head_dim: int) -> int:
        """Bytes of codes per head vector."""
        return head_dim // self.values_per_byte

    def bytes_per_vector(self, head_dim: int) -> int:
        """Codes plus fp16 scales for one head vector of one token."""
        return self.code_width(head_dim) + 2 * (head_dim // group_size(head_dim))

    def scales(self, xg: torch.Tensor) -> torch.Tensor:
        """xg: [..., n, group] fp32 -> scales [..., n] fp16."""
        amax = xg.abs().amax(dim=-1)
        return (amax / self.qmax).to(torch.float16).clamp_(SCALE_MIN, SCALE_MAX)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., D] any float -> (codes [..., code_width(D)], scales fp16 [..., D/G])."""
        g = group_size(x.shape[-1])
        xg = x.float().unflatten(-1, (-1, g))  # [..., n, G]
        scales = self.scales(xg)
        codes = self._to_codes(xg / scales.float()[..., None])
        return codes.flatten(-2), scales

    def decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(codes [..., W], scales [..., n]) -> values fp32 [..., D]."""
        y = self._from_codes(codes)  # [..., D] fp32
        return (y.unflatten(-1, (scales.shape[-1], -1)) * scales.float()[..., None]).flatten(-2)

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Quantizer(GroupQuantizer):
    """Codes -127..127 in int8 (symmetric, so -128 is never used)."""

    name, qmax = "int8", 127.0
    code_dtype = torch.int8

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        return torch.round(y).clamp_(-127, 127).to(torch.int8)

    def _from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.float()


class Int4Quantizer(GroupQuantizer):
    """Codes -8..7 (amax maps to 7), stored +8 as nibbles: element 2i low, 2i+1 high."""

    name, qmax = "int4", 7.0
    values_per_byte = 2
    code_dtype = torch.uint8

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        u = (torch.round(y).clamp_(-8, 7) + 8).to(torch.uint8).flatten(-2)  # [..., D]
        packed = u[..., 0::2] | (u[..., 1::2] << 4)  # [..., D/2]
        return packed.unflatten(-1, (y.shape[-2], -1))

    def _from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        nibbles = torch.stack((codes & 0x0F, codes >> 4), dim=-1)  # [..., D/2, 2]
        return nibbles.flatten(-2).float() - 8.0


class Fp8Quantizer(GroupQuantizer):
    """float8 e4m3fn values (max 448) kept as their uint8 bit patterns.

    The bits live in uint8 because indexing and `index_copy_` on float8 tensors are not
    implemented on every device; `view` reinterprets them for free.
    """

    name, qmax = "fp8", 448.0
    code_dtype = torch.uint8

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        # Clamp first: an fp16-rounded scale can put |y| a hair above 448, and the cast
        # of an out-of-range value is NaN on some devices rather than saturating.
        f8 = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return f8.view(torch.uint8)

    def _from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).float()


INT8 = Int8Quantizer()
INT4 = Int4Quantizer()
FP8 = Fp8Quantizer()
