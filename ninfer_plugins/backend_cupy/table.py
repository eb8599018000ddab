"""What the CuPy backend can serve, decided without importing CuPy where it can be.

`find_spec("cupy")` says whether CuPy is installed; only on a machine where torch sees
a CUDA device is CuPy imported, to ask `cupy.cuda.is_available()` (CuPy's first real
use raises `CUDARuntimeError` where no driver answers; `is_available()` says False
fast). A simulated device (`ninfer probe --device-spec`) is answered from its spec
alone, so probing on a CPU box never loads CuPy or a driver.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING

from ninfer_core.quant.formats import FORMATS
from ninfer_core.support import Support

if TYPE_CHECKING:
    import torch

    from ninfer_core.device import DeviceInfo
    from ninfer_core.kernels.workload import KernelWorkload

#: Oldest GPU generation the kernels are built for (NVRTC deprecates older ones).
MIN_SM = 70
#: bf16 activations: cuBLAS's bf16 GEMM (the prefill path) needs Ampere.
BF16_MIN_SM = 80
#: Quantized weight formats `kernels_cuda.py`'s kernels read as stored, and the
#: (bits, mins) layout of each.
LINEAR_FORMATS: dict[str, tuple[int, bool]] = {
    "Q4G64": (4, False),
    "Q5G64": (5, False),
    "Q6G64": (6, False),
    "W8G32": (8, False),
    "Q4G32": (4, False),
    "Q4G32M": (4, True),
    "Q5G32": (5, False),
}
#: Quantized formats no kernel here reads, dequantized once at load into the compute dtype
#: (`linear.pack_linear`): every other format of `FORMATS` (Q6G16, Q3G16 and Q2G16M, a
#: GGUF's Q6_K, Q3_K and Q2_K codes with a scale per 16 columns; Q5G32M, whose layout no
#: kernel instance here reads; and the formats of a GGUF's mixed fused groups).
DEQUANTIZED_FORMATS = frozenset(n for n, f in FORMATS.items() if f.quantized) - set(LINEAR_FORMATS)
#: Dense weights `linear` multiplies as they are (torch.matmul).
DENSE_FORMATS = frozenset({"fp16", "bf16", "fp32"})
#: The only op this backend provides.
OPS = ("linear",)
INSTALL_HINT = "CuPy is not installed (pip install 'ninfer[cupy]')"


def cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


@functools.cache
def cuda_runtime_support() -> Support:
    """Whether CuPy reaches a CUDA device on this machine (asked once per process)."""
    import torch

    if not torch.cuda.is_available():
        return Support.no("torch sees no CUDA device")
    try:
        import cupy

        if not cupy.cuda.is_available():
            return Support.no("CuPy sees no CUDA device (driver or CUDA version mismatch?)")
    except Exception as exc:  # a broken install refuses, it does not crash the probe
        return Support.no(f"CuPy failed to start: {type(exc).__name__}: {exc}")
    return Support.yes()


def device_support(device: DeviceInfo) -> Support:
    """Whether the CuPy kernels can run on `device` at all."""
    if not cupy_installed():
        return Support.no(INSTALL_HINT)
    if device.cuda is None:
        return Support.no("no CUDA device (CuPy compiles its CUDA C kernels for NVIDIA GPUs)")
    sm = device.cuda.sm_version
    if sm < MIN_SM:
        return Support.no(f"SM{sm} is older than SM{MIN_SM}, the oldest these kernels target")
    if device.simulated is None:
        runtime = cuda_runtime_support()
        if not runtime.ok:
            return runtime
    return Support.yes(f"CUDA C dequantize-GEMV kernels (NVRTC) for SM{sm}")


def dtype_support(device: DeviceInfo, dtype: torch.dtype | None) -> Support | None:
    """A refusal when the compute dtype can't run here, else None."""
    import torch

    if dtype is None:
        return None
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return Support.no(f"no CuPy kernels for {dtype} activations (fp16, bf16, fp32)")
    if dtype == torch.bfloat16 and device.cuda is not None:
        sm = device.cuda.sm_version
        if sm < BF16_MIN_SM:
            return Support.no(f"bf16 needs SM{BF16_MIN_SM}+, this is SM{sm}")
    return None


def op_support(device: DeviceInfo, workload: KernelWorkload | None) -> dict[str, Support]:
    """{"linear": Support} for `workload` on `device` (a field that is None is not known,
    and is not held against it)."""
    base = device_support(device)
    if not base.ok:
        return {"linear": base}
    refusal = dtype_support(device, workload.compute_dtype if workload else None)
    if refusal is not None:
        return {"linear": refusal}
    if workload is not None and workload.activation_dtype is not None:
        activations = workload.activation_dtype
        return {"linear": Support.no(f"no CuPy kernels for {activations} activations")}
    formats = workload.weight_formats if workload is not None else None
    if formats:
        read = LINEAR_FORMATS.keys() | DENSE_FORMATS | DEQUANTIZED_FORMATS
        missing = sorted(f for f in formats if f not in read)
        if missing:
            known = ", ".join(LINEAR_FORMATS)
            return {
                "linear": Support.no(
                    f"no CuPy GEMV for {', '.join(missing)} weights (reads {known})"
                )
            }
    return {"linear": base}
