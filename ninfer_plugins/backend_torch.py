"""The `torch` kernel backend: registers the core's reference ops
(`ninfer_core.kernels.reference.TorchOps`) as a backend that provides every op.

The names below are re-exported for code that imported them from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ninfer_core import hookimpl
from ninfer_core.device import DeviceInfo
from ninfer_core.kernels.reference import (  # noqa: F401  (re-exported)
    _INT4_CPU,
    Int4Linear,
    TorchOps,
    _decode_rows,
    gather_heads,
    int4_format_supported,
    int4_layout_known,
    unpack_int4pack,
)
from ninfer_core.support import Support

if TYPE_CHECKING:
    from ninfer_core.kernels.workload import KernelWorkload


class TorchBackend:
    name = "torch"
    description = "PyTorch reference kernels (F.linear, SDPA over gathered KV pages)"
    priority = 0
    provides = None  # every op, wherever `supports` says yes
    #: The reference gathers each sequence's pages (the CPU's in-place decode operator is
    #: counted by the workspace estimate itself).
    attention_scratch = None

    def supports(self, device: DeviceInfo) -> Support:
        return Support.yes("runs wherever torch runs")

    def create_ops(
        self, device: DeviceInfo | torch.device | str, *, workload: KernelWorkload | None = None
    ) -> TorchOps:
        where = device.torch_device if isinstance(device, DeviceInfo) else device
        return TorchOps(where, workload)


@hookimpl
def register_kernel_backends() -> list[TorchBackend]:
    return [TorchBackend()]
