"""What the fla backend can serve, decided without importing fla, Triton or CUDA.

`find_spec` says whether fla-core and Triton are installed; the device's SM says whether
fla's kernels run there. A simulated device (`ninfer probe --device-spec rtx3090`) is
answered from its spec alone, as the Triton backend answers, so probing on a CPU box
never loads fla (whose import reads the GPU's properties) or a driver.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from ninfer_core.support import Support

if TYPE_CHECKING:
    import torch

    from ninfer_core.device import DeviceInfo
    from ninfer_core.kernels.workload import KernelWorkload

#: The ops this backend provides: the two of a Gated DeltaNet layer.
OPS = ("gated_delta_rule", "causal_conv1d")
#: fla's chunked kernels are written for Ampere and newer (bf16 `tl.dot`, their tile
#: sizes sized for SM80's shared memory); its own CI runs nothing older.
MIN_SM = 80
INSTALL_HINT = "fla-core is not installed (pip install 'ninfer[fla]')"


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def device_support(device: DeviceInfo) -> Support:
    """Whether fla's kernels can run on `device` at all."""
    if not fla_installed():
        return Support.no(INSTALL_HINT)
    if not triton_installed():
        return Support.no("Triton is not installed (fla-core's kernels are Triton kernels)")
    if device.cuda is None:
        return Support.no(
            "no CUDA device (fla's Triton kernels run on NVIDIA GPUs; its chunked kernel "
            "does not run in Triton's interpreter)"
        )
    sm = device.cuda.sm_version
    if sm < MIN_SM:
        return Support.no(f"SM{sm} is older than SM{MIN_SM}, the oldest fla's kernels serve")
    return Support.yes(f"fla-core's Triton kernels for SM{sm}")


def dtype_support(dtype: torch.dtype | None) -> Support | None:
    """A refusal when fla has no kernels for the compute dtype, else None."""
    import torch

    if dtype is None or dtype in (torch.float16, torch.bfloat16, torch.float32):
        return None
    return Support.no(f"no fla kernels for {dtype} activations (fp16, bf16, fp32)")


def op_support(device: DeviceInfo, workload: KernelWorkload | None) -> dict[str, Support]:
    """{op: Support} for `workload` on `device`; every op is answered alike (both read
    the compute dtype only)."""
    base = device_support(device)
    refusal = dtype_support(workload.compute_dtype if workload else None) if base.ok else None
    return dict.fromkeys(OPS, base if refusal is None else refusal)
