"""`CupyOps`: the CuPy backend's members of the `KernelOps` contract (`linear`,
`pack_linear`, `packed_nbytes`); the host composes them with the other ops' backends
(`ninfer_core.kernels.compose`)."""

from __future__ import annotations

from typing import Any

import torch

from ninfer_plugins.backend_cupy import linear as cupy_linear


class CupyOps:
    name = "cupy"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)

    def linear(self, x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
        return cupy_linear.linear(x, w, b)

    def pack_linear(self, w: Any, *, dtype: torch.dtype | None = None) -> Any:
        # The codes are read as stored whatever the compute dtype; dense weights stay.
        return cupy_linear.pack_linear(w, self.device, dtype)

    def packed_nbytes(self, fmt_name: str, shape: tuple[int, int], *, dtype) -> int | None:
        return cupy_linear.packed_nbytes(fmt_name, shape, dtype)

    def __repr__(self) -> str:
        return f"CupyOps({self.device})"
