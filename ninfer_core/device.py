"""Capability probing: what this machine is, or what a named machine would be.

`probe_device()` reads the real machine; `simulated_device(name)` builds the
`DeviceInfo` of a known card so that plugin selection can be tested without it.
Probing CUDA goes through torch only when torch says CUDA is available, so a CPU
box never initialises a driver.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str
    cores: int
    memory_bytes: int
    isa: frozenset[str] = field(default_factory=frozenset)

    def has(self, flag: str) -> bool:
        return flag in self.isa


@dataclass(frozen=True, slots=True)
class CudaInfo:
    name: str
    sm: tuple[int, int]
    total_memory: int
    free_memory: int
    index: int = 0

    @property
    def sm_version(self) -> int:
        """SM as one number, e.g. 86 for an RTX 3090."""
        return self.sm[0] * 10 + self.sm[1]


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """The device plugins are asked about: the CPU always, a CUDA GPU when there is one."""

    cpu: CpuInfo
    cuda: CudaInfo | None = None
    simulated: str | None = None

    @property
    def kind(self) -> Literal["cpu", "cuda"]:
        return "cuda" if self.cuda is not None else "cpu"

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.cuda.index}" if self.cuda is not None else "cpu"

    def describe(self) -> str:
        cpu = self.cpu
        isa = ",".join(sorted(f for f in cpu.isa if f in _SHOWN_ISA)) or "baseline"
        text = f"CPU {cpu.model}: {cpu.cores} cores, {cpu.memory_bytes / GIB:.1f} GiB, ISA {isa}"
        if self.cuda is not None:
            c = self.cuda
            text += (
                f"\nGPU {c.name}: SM{c.sm_version}, {c.total_memory / GIB:.1f} GiB total, "
                f"{c.free_memory / GIB:.1f} GiB free"
            )
        if self.simulated:
            text += f"\n(simulated device spec {self.simulated!r})"
        return text

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["cpu"]["isa"] = sorted(self.cpu.isa)
        out["kind"] = self.kind
        return out


_SHOWN_ISA = {"avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "neon"}


def _read_cpu() -> CpuInfo:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if "asimd" in flags:
        flags.add("neon")
    memory = 0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return CpuInfo(model=model, cores=cores or 1, memory_bytes=memory, isa=frozenset(flags))


def _read_cuda() -> CudaInfo | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return CudaInfo(props.name, (props.major, props.minor), total, free, 0)


def probe_device(*, use_cuda: bool = True) -> DeviceInfo:
    """The real machine. `use_cuda=False` describes it as if it had no GPU."""
    return DeviceInfo(cpu=_read_cpu(), cuda=_read_cuda() if use_cuda else None)


#: Cards people run NInfer on, for `--device-spec` (free memory assumes an idle card).
DEVICE_SPECS: dict[str, CudaInfo | None] = {
    "cpu": None,
    "rtx3090": CudaInfo("NVIDIA GeForce RTX 3090", (8, 6), 24 * GIB, 23 * GIB),
    "rtx4090": CudaInfo("NVIDIA GeForce RTX 4090", (8, 9), 24 * GIB, 23 * GIB),
    "a100": CudaInfo("NVIDIA A100-SXM4-80GB", (8, 0), 80 * GIB, 79 * GIB),
    "h100": CudaInfo("NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB, 79 * GIB),
    "h200": CudaInfo("NVIDIA H200", (9, 0), 141 * GIB, 139 * GIB),
}


def simulated_device(name: str) -> DeviceInfo:
    """This machine's CPU with the named GPU (or none, for ``cpu``) in place of the real one."""
    from ninfer_core.errors import UnknownNameError

    key = name.lower()
    if key not in DEVICE_SPECS:
        raise UnknownNameError("device spec", name, DEVICE_SPECS)
    return replace(probe_device(use_cuda=False), cuda=DEVICE_SPECS[key], simulated=key)


# -- the CPU runtime's settings ------------------------------------------------------------

#: What the entry points set before torch loads, unless the user already has (docs/memory.md,
#: docs/performance.md). Read once, when the OpenMP runtime and oneDNN start, so setting them
#: after `import torch` does nothing.
CPU_RUNTIME_ENV = {
    # GNU OpenMP threads spin a bounded while at a barrier, then sleep. Its default spin
    # (300,000) steals the time slice a descheduled sibling needs: decode 5-50x slower on
    # a busy box. Not spinning at all (OMP_WAIT_POLICY=PASSIVE) pays a wake-up per parallel
    # region, 2.6x slower decode on a quiet one. 10,000 was as fast as the default quiet
    # and as passive beside busy processes (docs/performance.md).
    "GOMP_SPINCOUNT": "10000",
    # oneDNN (and ideep, torch's wrapper) keep one compiled kernel per matmul shape, about
    # 1 MiB each, 1024 of each by default: prompts of many lengths grew RSS by GBs.
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128",
    "LRU_CACHE_CAPACITY": "128",
}
#: oneDNN's and ideep's own default cache capacity, where nothing sets one.
DEFAULT_KERNEL_CACHE_CAPACITY = 1024


def configure_cpu_runtime(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set `CPU_RUNTIME_ENV`'s defaults in `environ` (default `os.environ`) where unset (the
    spin count also where `OMP_WAIT_POLICY` is set); return what was set. Call before torch
    is imported: the entry points do."""
    env = os.environ if environ is None else environ
    chosen = {k: v for k, v in CPU_RUNTIME_ENV.items() if k not in env}
    if "OMP_WAIT_POLICY" in env:  # the user chose how OpenMP threads wait: keep it
        chosen.pop("GOMP_SPINCOUNT", None)
    env.update(chosen)
    return chosen


def kernel_cache_capacity(environ: dict[str, str] | None = None) -> int:
    """Compiled CPU kernels the process keeps at most per cache (the larger of the two)."""
    env = os.environ if environ is None else environ
    sizes = []
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        try:
            sizes.append(max(int(env.get(name, DEFAULT_KERNEL_CACHE_CAPACITY)), 0))
        except ValueError:
            sizes.append(DEFAULT_KERNEL_CACHE_CAPACITY)
    return max(sizes)


def thread_summary() -> str:
    """The CPU threads the runtime uses and how they wait, for startup output:
    `torch threads: 2 (GOMP_SPINCOUNT=10000: spin, then sleep)`."""
    import torch

    if policy := os.environ.get("OMP_WAIT_POLICY"):
        wait = f"OMP_WAIT_POLICY={policy}"
    elif spin := os.environ.get("GOMP_SPINCOUNT"):
        wait = f"GOMP_SPINCOUNT={spin}: spin, then sleep"
    else:
        wait = "OpenMP's default wait: spin 300,000 times, then sleep"
    return f"torch threads: {torch.get_num_threads()} ({wait})"
