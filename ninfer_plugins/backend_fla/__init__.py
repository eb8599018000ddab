"""The `fla` kernel backend: the Gated DeltaNet ops (`gated_delta_rule`,
`causal_conv1d`) of hybrid models (Qwen3-Next, Qwen3.5) from flash-linear-attention's
Triton kernels (PyPI `fla-core`), on NVIDIA GPUs of SM80 or newer
(`docs/gpu-backends.md`).

Prefill chunks run fla's chunked gated delta rule and decode rows its fused recurrent
kernel; the convolution runs fla's causal conv1d kernels. Every other op comes from the
next backend. Probing imports neither fla nor Triton (`table.py`); only `create_ops`
loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.support import Support
from ninfer_plugins.backend_fla import table

if TYPE_CHECKING:
    import torch

    from ninfer_core.kernels.workload import KernelWorkload
    from ninfer_plugins.backend_fla.ops import FlaOps


class FlaBackend:
    name = "fla"
    description = "flash-linear-attention's Triton kernels: gated delta rule, causal conv1d"
    #: Above CuPy's (10), below Triton's (20); it provides only the two ops no other
    #: GPU backend does, so on a GPU it wins them over the reference (0).
    priority = 15
    attention_scratch = None  # it provides no attention

    def supports(self, device: DeviceInfo) -> Support:
        return table.device_support(device)

    def provides(
        self, device: DeviceInfo, *, workload: KernelWorkload | None = None
    ) -> dict[str, Support]:
        return table.op_support(device, workload)

    def create_ops(self, device: DeviceInfo | torch.device | str) -> FlaOps:
        from ninfer_plugins.backend_fla.ops import FlaOps

        where = device.torch_device if isinstance(device, DeviceInfo) else device
        return FlaOps(where)

    def __repr__(self) -> str:
        return f"FlaBackend({self.name})"


@hookimpl
def register_kernel_backends() -> list[FlaBackend]:
    return [FlaBackend()]
