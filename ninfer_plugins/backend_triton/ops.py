"""`TritonOps`: the Triton backend's kernels behind the `KernelOps` contract.

Each op is a module's function (`linear.py`, `attention.py`, `norms.py`, and
`int8_linear.py` for prefill linears with `--activation-dtype int8`); this class
only binds them, so a kernel module can be read, tested and replaced on its own. The
kernel modules import Triton, so this module is imported only when a backend creates
its ops (never while probing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ninfer_core.kernels.int8_act import PREFILL_MIN_ROWS
from ninfer_core.model.ops import KernelOps
from ninfer_core.quant.tensor import QuantizedTensor
from ninfer_plugins.backend_triton import attention, int8_linear, linear, norms

if TYPE_CHECKING:
    from ninfer_core.kernels.workload import KernelWorkload
    from ninfer_core.model.attention_meta import AttentionMetadata


class TritonOps(KernelOps):
    name = "triton"

    def __init__(
        self, device: torch.device | str = "cuda", workload: KernelWorkload | None = None
    ) -> None:
        super().__init__(device)
        #: What will run (None where the host did not say); kernels that depend on it
        #: (the activation dtype of prefill linears) read it from here.
        self.workload = workload
        self._int8_acts = workload is not None and workload.int8_activations

    def prepare(self, meta: AttentionMetadata) -> None:
        attention.prepare(meta)

    def linear(self, x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
        # A prefill's rows over a quantized weight, with --activation-dtype int8: W8A8 /
        # W4A8 on integer tensor cores. Decode and speculative rounds keep x's dtype.
        if self._int8_acts and isinstance(w, QuantizedTensor) and x.shape[0] > PREFILL_MIN_ROWS:
            return int8_linear.int8_linear(x, w.packed, w.scales, w.fmt.name, w.shape[0], b)
        return linear.linear(x, w, b)

    def pack_linear(self, w: Any, *, dtype: torch.dtype | None = None) -> Any:
        if self._int8_acts and isinstance(w, QuantizedTensor):
            # Kept as stored: the int8 GEMM reads its codes, and `linear.linear` takes a
            # `QuantizedTensor` as it is for the decode rows.
            return w
        return linear.pack_linear(w, dtype=dtype)

    def packed_nbytes(self, fmt_name: str, shape: tuple[int, int], *, dtype) -> int | None:
        return linear.packed_nbytes(fmt_name, shape, dtype=dtype)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return norms.rms_norm(x, w, eps)

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return norms.silu_and_mul(gate, up)

    def apply_rope(self, q, k, cos, sin):
        return norms.apply_rope(q, k, cos, sin)

    def paged_attention(self, q, k_new, v_new, kv_store, layer, meta, scale):
        return attention.paged_attention(q, k_new, v_new, kv_store, layer, meta, scale)
