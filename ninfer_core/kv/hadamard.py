"""Normalized Hadamard rotations over the head dimension (used by `rk8v4`).

Multiplying a head vector by an orthonormal Hadamard matrix spreads one large channel
evenly over all of them, so a group's absmax scale no longer has to cover an outlier
and the other values keep their precision. Because `H` is orthonormal, `(qH)·(kH) = q·k`
and `xHHᵀ = x`: the rotation can be undone exactly (up to float rounding).

Head dims that are not a power of two are not refused: the rotation is block-diagonal,
one Hadamard block per `hadamard_block(D)` channels (the largest power of two dividing
D, e.g. 32 for D = 96). It stays orthonormal; it only spreads outliers within a block.
"""

from __future__ import annotations

import functools

import torch


def hadamard_block(head_dim: int) -> int:
    """Size of the Hadamard blocks for `head_dim`: its largest power-of-two divisor."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return head_dim & -head_dim


@functools.cache
def _sylvester(n: int) -> torch.Tensor:
    """Unnormalized ±1 Hadamard of order n (a power of two), float64: [[H, H], [H, -H]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """Normalized Hadamard matrix [n, n] (n a power of two): symmetric and orthonormal."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    return (_sylvester(n) / n**0.5).to(dtype=dtype, device=device)


class HeadRotation:
    """x ↦ x·H over the last dim, H block-diagonal with normalized Hadamard blocks."""

    def __init__(self, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.head_dim = head_dim
        self.block = hadamard_block(head_dim)
        self.matrix = hadamard(self.block, torch.float32, device)  # [P, P]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> x·H [..., D] fp32."""
        xb = x.float().unflatten(-1, (-1, self.block))  # [..., D/P, P]
        return (xb @ self.matrix).flatten(-2)

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> x·Hᵀ [..., D] fp32 (H is symmetric, so Hᵀ = H = H⁻¹)."""
        xb = x.float().unflatten(-1, (-1, self.block))
        return (xb @ self.matrix.T).flatten(-2)
