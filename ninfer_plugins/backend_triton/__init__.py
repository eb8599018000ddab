"""The `triton` kernel backend: fused dequantize + GEMM for NInfer's weight formats,
paged attention that reads the KV codecs' pages in place, and fused norms and RoPE, as
Triton kernels for NVIDIA GPUs (`docs/gpu-backends.md`).

It serves the ops `table.py` lists for the workload (weight formats, KV codec, compute
dtype) and refuses the rest with a reason; the Gated DeltaNet ops, and any op it
refuses, come from the next backend and finally from the torch reference. Probing
imports no Triton: only `create_ops` loads the kernels. Under `TRITON_INTERPRET=1` the
kernels run on the CPU in Triton's interpreter (fp16/fp32 only), which is how the test
suite checks them without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.support import Support
from ninfer_plugins.backend_triton import table

if TYPE_CHECKING:
    import torch

    from ninfer_core.kernels.workload import KernelWorkload


class TritonBackend:
    name = "triton"
    description = "Triton kernels: fused dequantize + GEMM, paged attention over KV codes, norms"
    #: Above the CuPy backend's and the reference's: where it serves an op, it is the fastest.
    priority = 20
    #: Its paged attention reads the KV pages in place: the plan counts this, not a copy.
    attention_scratch = staticmethod(table.attention_scratch)

    def supports(self, device: DeviceInfo) -> Support:
        return table.device_support(device)

    def provides(
        self, device: DeviceInfo, *, workload: KernelWorkload | None = None
    ) -> dict[str, Support]:
        return table.op_support(device, workload)

    def create_ops(
        self, device: DeviceInfo | torch.device | str, *, workload: KernelWorkload | None = None
    ):
        from ninfer_plugins.backend_triton.ops import TritonOps

        where = device.torch_device if isinstance(device, DeviceInfo) else device
        return TritonOps(where, workload)

    def __repr__(self) -> str:
        return f"TritonBackend({self.name})"


@hookimpl
def register_kernel_backends() -> list[TritonBackend]:
    return [TritonBackend()]
