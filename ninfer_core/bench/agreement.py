"""How close one run's numbers are to a reference run's: relative RMS and top-1 agreement.

The docs' error tables (quantized weights against bf16, quantized KV against fp16) and the
tests that hold them to their bounds all use these two figures, computed here in float64
so the error of the measurement itself is negligible next to what it measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """`||got - want|| / ||want||` over every element (the RMS ratio, same count on both)."""
    want64 = want.double()
    return ((got.double() - want64).norm() / want64.norm()).item()


@dataclass(frozen=True)
class LogitAgreement:
    """Relative RMS error over all logits, and the share of positions with the same top-1."""

    rel_rms: float
    top1: float


def logit_agreement(got: torch.Tensor, want: torch.Tensor) -> LogitAgreement:
    """Compare `[positions, vocab]` logits with a reference run's."""
    if got.shape != want.shape:
        raise ValueError(f"logit shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    same = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
    return LogitAgreement(rel_rms(got, want), same)
