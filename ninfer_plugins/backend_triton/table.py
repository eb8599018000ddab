"""What the Triton backend can serve, per op, decided without importing Triton.

`TritonBackend.provides` answers from these tables and the `KernelWorkload` (weight
formats, KV codec, compute dtype), so `ninfer probe` on a machine without a GPU (or
without Triton installed) never loads Triton or initialises a driver. The kernels
themselves live in `linear.py`, `attention.py` and `norms.py`; each table below states
what its module's kernels read.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

from ninfer_core.quant.formats import FORMATS
from ninfer_core.support import Support

if TYPE_CHECKING:
    import torch

    from ninfer_core.device import DeviceInfo
    from ninfer_core.kernels.workload import KernelWorkload

#: Oldest GPU generation Triton 3 compiles for (Turing: fp16 tensor cores).
MIN_SM = 75
#: bf16 arithmetic and tensor-core bf16 MMA arrived with Ampere.
BF16_MIN_SM = 80
#: Weight formats `linear.py`'s fused dequantize + GEMM kernels read as stored
#: (`ninfer_core.quant.formats`: Q4_0 is Q4G32, Q4_1 Q4G32M, Q8_0 W8G32, Q5_0 Q5G32,
#: Q5_1 and Q5_K Q5G32M).
LINEAR_FORMATS = frozenset(
    {"Q4G64", "Q5G64", "Q6G64", "W8G32", "Q4G32", "Q4G32M", "Q5G32", "Q5G32M"}
)
#: Quantized formats no kernel here reads, dequantized once at load into the compute dtype
#: (`linear.pack_linear`): every other format of `FORMATS`. Q6G16, Q3G16 and Q2G16M (a
#: GGUF's Q6_K, Q3_K and Q2_K codes) have a scale per 16 columns, narrower than the
#: kernels' K blocks; the rest hold a GGUF's mixed fused groups.
DEQUANTIZED_FORMATS = frozenset(n for n, f in FORMATS.items() if f.quantized) - LINEAR_FORMATS
#: Weight formats `int8_linear.py`'s W8A8 / W4A8 prefill GEMM reads
#: (`--activation-dtype int8`): symmetric 8- and 4-bit codes.
INT8_ACT_FORMATS = frozenset({"W8G32", "Q4G64", "Q4G32"})
#: Integer (int8 x int8 -> int32) tensor-core MMA, as Triton emits it, needs Ampere.
INT8_MMA_MIN_SM = 80
#: Dense weights `linear` multiplies as they are.
DENSE_FORMATS = frozenset({"fp16", "bf16", "fp32"})
#: KV codecs whose pages `attention.py` reads in place (dequantizing inside the kernel).
ATTENTION_KV_CODECS = frozenset({"fp16", "bf16", "fp32", "int8", "rk8v4"})
#: The ops this backend provides; the Gated DeltaNet ops come from the reference.
OPS = ("linear", "attention", "rms_norm", "rope", "silu_and_mul")
#: Keys per split-KV part of a few-row sequence, at least (`attention.py`: a part shorter
#: than this costs more to merge than it saves).
MIN_SPLIT = 256


def attention_scratch(
    *,
    tokens: int,
    few_rows: int,
    context: int,
    num_heads: int,
    head_dim: int,
    dtype_bytes: int,
    rotated: bool,
) -> int:
    """What `attention.paged_attention` allocates for one layer (`AttentionScratch`): the
    output [T, H, D]; with a rotated store the rotated q and output (each through an fp32
    product) and the step's new K/V rotated for encoding; and, for the few-row
    sequences, the split-KV partials and their (max, sum) in fp32, at most one part per
    `MIN_SPLIT` keys. Prefill tiles keep their running softmax in registers and read the
    pages in place, so nothing of the context is copied."""
    values = tokens * num_heads * head_dim
    out = values * dtype_bytes
    # q and the output through fp32 products, and the new K/V rotated and encoded in fp32
    # (at most one per query head); index tensors (slots, rows) a few words a token.
    rotation = 2 * values * (4 + dtype_bytes) + 2 * values * 4 if rotated else 0
    indices = 16 * tokens
    parts = max(1, context // MIN_SPLIT) if few_rows else 0
    partials = parts * few_rows * num_heads * (head_dim + 2) * 4 if parts > 1 else 0
    return out + rotation + partials + indices


def interpreting() -> bool:
    """Whether Triton's interpreter is on (`TRITON_INTERPRET=1`): kernels then run on the
    CPU, slowly, with numpy; the test suite checks them that way. Read at import time of
    a kernel module, as Triton reads it when it decorates a kernel."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def device_support(device: DeviceInfo) -> Support:
    """Whether Triton kernels can run on `device` at all."""
    if not triton_installed():
        return Support.no("Triton is not installed (pip install 'ninfer[triton]')")
    if device.cuda is None:
        if interpreting():
            return Support.yes("TRITON_INTERPRET=1: kernels run in Triton's interpreter on the CPU")
        return Support.no(
            "no CUDA device (Triton compiles for NVIDIA GPUs; TRITON_INTERPRET=1 runs its "
            "kernels on the CPU, for tests)"
        )
    sm = device.cuda.sm_version
    if sm < MIN_SM:
        return Support.no(f"SM{sm} is older than SM{MIN_SM}, the oldest Triton 3 compiles for")
    return Support.yes(f"Triton kernels compiled for SM{sm}")


def dtype_support(device: DeviceInfo, dtype: torch.dtype | None) -> Support | None:
    """A refusal when the compute dtype can't run here, else None."""
    import torch

    if dtype is None:
        return None
    if dtype == torch.bfloat16:
        if device.cuda is None and interpreting():
            return Support.no("Triton's interpreter computes bf16 wrongly (run fp16 or fp32)")
        if device.cuda is not None and device.cuda.sm_version < BF16_MIN_SM:
            return Support.no(f"bf16 needs SM{BF16_MIN_SM}+, this is SM{device.cuda.sm_version}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return Support.no(f"no kernels for {dtype} activations")
    return None


def op_support(device: DeviceInfo, workload: KernelWorkload | None) -> dict[str, Support]:
    """{op: Support} for `workload` on `device` (a `KernelWorkload` field that is None is
    not known, and is not held against the op)."""
    base = device_support(device)
    if not base.ok:
        return dict.fromkeys(OPS, base)
    dtype_refusal = dtype_support(device, workload.compute_dtype if workload else None)
    if dtype_refusal is not None:
        return dict.fromkeys(OPS, dtype_refusal)
    out = dict.fromkeys(OPS, base)
    formats = workload.weight_formats if workload is not None else None
    if formats:
        read = LINEAR_FORMATS | DENSE_FORMATS | DEQUANTIZED_FORMATS
        missing = sorted(f for f in formats if f not in read)
        if missing:
            out["linear"] = Support.no(f"no Triton GEMM for {', '.join(missing)} weights")
    if workload is not None and workload.activation_dtype is not None and out["linear"].ok:
        out["linear"] = activation_support(device, workload)
    codec = workload.kv_codec if workload is not None else None
    if codec is not None and codec not in ATTENTION_KV_CODECS:
        known = ", ".join(sorted(ATTENTION_KV_CODECS))
        out["attention"] = Support.no(f"no Triton attention for {codec} pages (reads {known})")
    return out


def activation_support(device: DeviceInfo, workload: KernelWorkload) -> Support:
    """Whether `linear` can run `workload.activation_dtype` activations: int8 over the
    formats of `INT8_ACT_FORMATS`, with integer MMA (SM80+) or in the interpreter."""
    want = workload.activation_dtype
    if want != "int8":
        return Support.no(f"no Triton GEMM for {want} activations (int8 only)")
    if device.cuda is not None and device.cuda.sm_version < INT8_MMA_MIN_SM:
        sm = device.cuda.sm_version
        return Support.no(
            f"int8 activations need integer MMA on SM{INT8_MMA_MIN_SM}+, this is SM{sm}"
        )
    missing = sorted(workload.quantized_formats - INT8_ACT_FORMATS)
    if missing:
        known = ", ".join(sorted(INT8_ACT_FORMATS))
        return Support.no(
            f"no int8-activation GEMM for {', '.join(missing)} weights (reads {known})"
        )
    return Support.yes("int8 activations for prefill (W8A8/W4A8 integer MMA)")
