"""The CPU decode GEMVs of `csrc/cpu_gemv.cpp`, built at run time, and `GemvLinear`.

A decode step is bound by how fast its weight matrices stream from memory. At SmolLM2's
and Qwen3-0.6B's shapes on 2 threads, oneDNN's bf16 GEMV over its packed layout reads
about 17-19 GB/s of the ~35 GB/s the machine reads; a plain AVX512-BF16 loop over the
row-major matrix (eight rows a block, the next block prefetched) reads 19-21 GB/s, and
SmolLM2's bf16 decode goes about 10% faster (docs/performance.md). The loop is C++
registered as a torch operator, so a compiled decode step calls it from its C++ wrapper
with no Python in between.

It is built once per machine with torch's extension builder (a C++ compiler and ninja;
cached under torch's extension folder) when the CPU has AVX512-BF16. Without either,
`available()` says why and dense bf16 weights stay on oneDNN (`OneDNNLinear`): the
same results to bf16 rounding, at oneDNN's speed. `NINFER_CPU_GEMV=0` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_gemv.cpp"
#: `-fopenmp`: `at::parallel_for` is a header template whose threads are OpenMP pragmas,
#: compiled here; without it every call runs on one thread.
_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.cache
def unavailable() -> str | None:
    """Why the GEMV operators can't run in this process, or None once they are built
    and loaded (the first call builds them: seconds, or a minute the first time on a
    machine)."""
    if os.environ.get("NINFER_CPU_GEMV", "1") == "0":
        return "NINFER_CPU_GEMV=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if "avx512_bf16" not in _cpu_flags():
        return "the CPU lacks AVX512-BF16"
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="ninfer_cpu_gemv", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )  # fmt: skip
    except Exception as exc:  # no compiler, no ninja, a build error: oneDNN serves
        lines = str(exc).strip().splitlines() or [""]
        said = next((ln for ln in lines if "error:" in ln), lines[0])  # the compiler's
        reason = f"{type(exc).__name__}: {said.strip()[:300]}"
        log.warning("CPU GEMV kernels not built, dense bf16 decode stays on oneDNN: %s", reason)
        return reason
    _register_fake()
    return None


def available() -> bool:
    return unavailable() is None


def _require() -> None:
    if (reason := unavailable()) is not None:
        raise RuntimeError(f"the CPU GEMV kernels are not available: {reason}")


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ w[N, K].T -> [M, N] bf16, through the built operator."""
    return torch.ops.ninfer_cpu.gemv_bf16(x, w)


@functools.cache
def _register_fake() -> None:
    """The operator's shape rule for the compiler (once, after its library is loaded)."""

    @torch.library.register_fake("ninfer_cpu::gemv_bf16")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))


class GemvLinear:
    """A dense bf16 `[out, in]` weight kept row-major: decode rows (up to `MAX_ROWS`) run
    the AVX512-BF16 GEMV, more rows (a prefill chunk) `F.linear`, which reaches within
    10% of oneDNN's packed GEMM at 512 rows here. One copy of the weight serves both."""

    #: Rows of x that still take the GEMV (decode batches, speculative rounds); each row
    #: beyond the first re-reads the weight from cache.
    MAX_ROWS = 16

    def __init__(self, w: torch.Tensor) -> None:
        _require()
        self.weight = w.detach().contiguous()
        self.out_features, self.in_features = (int(n) for n in w.shape)
        self.dtype = w.dtype

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] > self.MAX_ROWS:
            return F.linear(x, self.weight, b)
        y = gemv_bf16(x, self.weight)
        return y if b is None else y + b

    def __repr__(self) -> str:
        return f"GemvLinear([{self.out_features}, {self.in_features}], {self.dtype})"
