"""The `cupy` kernel backend: NInfer's quantized weights multiplied by CUDA C kernels
compiled at run time through CuPy (NVRTC), for NVIDIA GPUs (`docs/gpu-backends.md`).

It provides `linear` only, below Triton's priority: it serves where Triton is not
installed or refuses a workload (a format or dtype), and every other op comes from the
next backend. Decode rows run a dequantize-GEMV kernel that reads the packed codes in
place; a prefill chunk dequantizes the weight a tile at a time and multiplies with
cuBLAS. Probing imports no CuPy (`table.py`); only `create_ops` loads the launcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.support import Support
from ninfer_plugins.backend_cupy import table

if TYPE_CHECKING:
    import torch

    from ninfer_core.kernels.workload import KernelWorkload
    from ninfer_plugins.backend_cupy.ops import CupyOps


class CupyBackend:
    name = "cupy"
    description = "CuPy/NVRTC CUDA C kernels: dequantize-GEMV over packed weight codes"
    #: Below Triton's (20), above the reference's (0).
    priority = 10
    attention_scratch = None  # it provides no attention

    def supports(self, device: DeviceInfo) -> Support:
        return table.device_support(device)

    def provides(
        self, device: DeviceInfo, *, workload: KernelWorkload | None = None
    ) -> dict[str, Support]:
        return table.op_support(device, workload)

    def create_ops(self, device: DeviceInfo | torch.device | str) -> CupyOps:
        from ninfer_plugins.backend_cupy.ops import CupyOps

        where = device.torch_device if isinstance(device, DeviceInfo) else device
        return CupyOps(where)

    def __repr__(self) -> str:
        return f"CupyBackend({self.name})"


@hookimpl
def register_kernel_backends() -> list[CupyBackend]:
    return [CupyBackend()]
