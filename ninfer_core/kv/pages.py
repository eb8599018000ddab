"""`KVPages`: a store's raw page pools of one layer, for kernels that read them in place.

A fused attention kernel reads K and V straight from the pool through the block table,
decoding codes inside the kernel, so no dequantized copy of the context is ever made.
It needs to know where the pools are and how each is encoded; `KVStore.raw_pages(layer)`
answers with these descriptions (views of the live pools, not copies: a `write` is
visible in them at once).

Every pool is indexed `[num_blocks, block_size, Hkv, W]` (a strided view where the
store keeps another order; kernels must read `stride()`, never assume contiguity). A
value of head dim `d` is decoded as

- `encoding == "float"`: `values[..., d]` as stored (fp16/bf16/fp32, `bits` 16 or 32);
- `encoding == "int"`: symmetric integer codes times `scales[..., d // group]` (fp16).
  `bits == 8`: int8 codes, `W = D`. `bits == 4`: unsigned nibbles stored `code + 8`, two
  per byte, value `2i` in the low nibble of byte `i` and `2i + 1` in the high one,
  `W = D / 2`;
- `encoding == "fp8_e4m3"`: float8 e4m3 bit patterns in uint8, times the group scale.

With `rotation` set (rk8v4), both pools hold `x·H`: a kernel rotates the query by H
(`qH·kH = q·k`) and its output by Hᵀ, instead of un-rotating every cached token.

A coded pool may name its store's `encoder` (`kv/quant.py`'s quantizer of its codes): a
kernel that attends to rows not yet stored (a compiled step's own keys, returned and
written after the graph) then codes them as the store will, so they read as a lone
decode later finds them in the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from ninfer_core.kv.hadamard import HeadRotation
    from ninfer_core.kv.quant import GroupQuantizer

Encoding = Literal["float", "int", "fp8_e4m3"]


@dataclass(frozen=True, slots=True)
class PagePool:
    """One layer's K (or V) pool, as stored."""

    #: [num_blocks, block_size, Hkv, W]: the values (float) or codes (int, fp8).
    values: torch.Tensor
    #: [num_blocks, block_size, Hkv, D / group] fp16, or None for `encoding == "float"`.
    scales: torch.Tensor | None
    encoding: Encoding
    #: Bits per stored value: 16 or 32 (float), 8 (int8, fp8), 4 (int4, two per byte).
    bits: int
    #: Head-dim values sharing one scale (the head dim itself for unscaled float pools).
    group: int
    #: The store's encoder of this pool's codes (`encode(x) -> codes, scales`, in the
    #: stored space: after `rotation`), or None (float pools; a coded pool that does not
    #: say, whose pages a kernel then reads only with nothing new beside them).
    encoder: GroupQuantizer | None = None

    def __post_init__(self) -> None:
        if (self.scales is None) != (self.encoding == "float"):
            raise ValueError(f"a {self.encoding} pool needs scales exactly when it is coded")
        if self.values.dim() != 4:
            raise ValueError(f"pages must be [NB, BS, Hkv, W], got {tuple(self.values.shape)}")


@dataclass(frozen=True, slots=True)
class KVPages:
    """K and V pools of one layer, and the rotation they are stored in (or None)."""

    k: PagePool
    v: PagePool
    head_dim: int
    rotation: HeadRotation | None = None

    def read_back(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [..., D] as these pools will keep them, decoded back to the original space
        in fp32: what a later step reads of rows written now (rotated, coded by the pool's
        `encoder`, or cast to the pages' dtype). A coded pool needs its encoder."""
        out = []
        for pool, x in ((self.k, k), (self.v, v)):
            if self.rotation is not None:
                x = self.rotation.forward(x)
            if pool.encoding == "float":
                x = x.to(pool.values.dtype).float()
            else:
                if pool.encoder is None:
                    raise ValueError(f"a {pool.encoding} pool that names no encoder")
                x = pool.encoder.decode(*pool.encoder.encode(x))
            out.append(x if self.rotation is None else self.rotation.inverse(x))
        return out[0], out[1]

    @property
    def block_size(self) -> int:
        return int(self.k.values.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.values.shape[2])
