"""A linear over a weight that is only ever materialized a row chunk at a time.

A prefill chunk multiplies many rows by each weight, which dense GEMMs do far faster
than a decode kernel that re-decodes the weight for every few rows. Quantized weights
are dequantized one chunk of output rows at a time, so the whole dense matrix is never
resident.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def linear_by_row_chunks(
    x: torch.Tensor,
    b: torch.Tensor | None,
    out_features: int,
    step: int,
    chunk: Callable[[torch.Tensor, int, int], torch.Tensor],
) -> torch.Tensor:
    """`[T, out_features]` in x's dtype: `chunk(x, start, n)` gives output columns
    `start:start + n` (`step` at a time), plus the bias."""
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    for start in range(0, out_features, step):
        n = min(step, out_features - start)
        y = chunk(x, start, n)
        out[:, start : start + n] = y if b is None else y + b[start : start + n]
    return out
