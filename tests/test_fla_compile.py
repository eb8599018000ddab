"""fla's kernels, as the fla backend launches them, compiled for SM80, SM86 and SM90 with
no GPU here (`test_triton_compile.py` does the same for our own Triton kernels).

fla chooses its tile sizes and autotune configs from the GPU it finds when imported
(shared memory, Hopper or not) and launches a chain of kernels per op (the chunked
gated delta rule alone is five), so rather than typing each kernel's signature by hand
the child process (`compile_for`) stands in a driver for the card: Triton and fla see
an SM`arch` device with its shared memory, and every launch compiles the kernel for it
(`JITFunction._do_compile`) instead of running it. Then `FlaOps` runs its ops on CPU
tensors at Qwen3.5's head sizes in fp16 and bf16 — prefill (chunked), decode and
few-row (recurrent) steps, a decode and a prefill convolution — so each kernel is
compiled with the arguments, heuristics and constexprs our calls give it. The
autotuner's benchmark compiles every config it would time; a config needing more
shared memory than the card has raises `OutOfResources` there as it would on the
card (and is passed over). What comes back: every launched kernel compiled, at least
one config of each autotuned kernel fits the card, and the chunked kernels' matmuls
run on tensor cores (MMA in the PTX)."""

from __future__ import annotations

import importlib.util
import json
import types

import pytest
from triton_helpers import run_compile_script

#: (name, SMs, shared memory per block, opt-in) of the card each arch stands for.
CARDS = {
    80: ("NVIDIA A100-SXM4-80GB", 108, 166912),
    86: ("NVIDIA GeForce RTX 3090", 82, 101376),
    90: ("NVIDIA H100 80GB HBM3", 132, 232448),
}
#: Qwen3.5's Gated DeltaNet: 16 key heads, 32 value heads of 128, a conv of width 4
#: over q | k | v.
HK, HV, D, WIDTH = 16, 32, 128, 4
#: Kernels whose matmuls must be on tensor cores (`mma` / Hopper's `wgmma`).
MMA_KERNELS = (
    "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
    "recompute_w_u_fwd_kernel",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
    "chunk_fwd_kernel_o",
)


def fake_gpu(arch: int) -> list[dict]:
    """Make this process look like it holds the card of `arch` to Triton and fla, with
    every kernel launch compiled for it and not run; returns the list each compiled
    kernel is recorded in. Call before importing fla."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as triton_driver
    from triton.runtime.errors import OutOfResources
    from triton.runtime.jit import JITFunction

    name, sms, smem = CARDS[arch]
    target = GPUTarget("cuda", arch, 32)
    compiled: list[dict] = []
    cache: dict = {}

    def bench(kernel_call, quantiles=None, **_):
        kernel_call()  # compiles the config; OutOfResources propagates to the autotuner
        return [1.0, 1.0, 1.0]

    props = {"max_shared_mem": smem, "multiprocessor_count": sms}
    fake = types.SimpleNamespace(
        get_current_device=lambda: 0,
        get_current_stream=lambda device=None: 0,
        get_current_target=lambda: target,
        get_benchmarker=lambda: bench,
        get_active_torch_device=lambda: torch.device("cpu"),
        utils=types.SimpleNamespace(get_device_properties=lambda index=0: props),
    )
    triton_driver.set_active(fake)
    device_props = types.SimpleNamespace(
        name=name, major=arch // 10, minor=arch % 10, multi_processor_count=sms,
        shared_memory_per_block=49152, shared_memory_per_block_optin=smem,
        total_memory=80 << 30,
    )  # fmt: skip
    torch.cuda.get_device_capability = lambda device=None: (arch // 10, arch % 10)
    torch.cuda.get_device_name = lambda device=None: name
    torch.cuda.get_device_properties = lambda device=None: device_props
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        if key not in cache:
            src = self.ASTSource(self, signature, constexprs, attrs)
            kernel = triton.compile(src, target=target, options=options.__dict__)
            ptx = kernel.asm["ptx"]
            cache[key] = kernel.metadata.shared
            compiled.append(
                {
                    "kernel": self.fn.__name__,
                    "dtypes": sorted({t for t in signature.values() if t.startswith("*")}),
                    "warps": options.num_warps,
                    "stages": options.num_stages,
                    "shared": kernel.metadata.shared,
                    "fits": kernel.metadata.shared <= smem,
                    "mma": "mma" in ptx,
                }
            )
        if cache[key] > smem:  # as the launch on the card would raise
            raise OutOfResources(cache[key], smem, "shared memory")
        return None  # nothing to launch: `run` returns here

    JITFunction._do_compile = do_compile
    return compiled


def run_ops(dtype) -> None:
    """The fla backend's ops on CPU tensors at Qwen3.5's head sizes: every path it takes."""
    import torch

    from ninfer_plugins.backend_fla.ops import FlaOps

    ops = FlaOps("cpu")
    conv_dim = 2 * HK * D + HV * D
    for lengths in ([1, 1, 1], [3, 1, 16], [70, 20], [40, 2]):
        t, b = sum(lengths), len(lengths)
        offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        q, k = (torch.randn(t, HK, D, dtype=dtype) for _ in range(2))
        v = torch.randn(t, HV, D, dtype=dtype)
        g = -torch.rand(t, HV)  # fp32 log-decays, as the hybrid layers pass them
        beta = torch.rand(t, HV, dtype=dtype)
        states = torch.zeros(b, HV, D, D)
        ops.gated_delta_rule(q, k, v, g, beta, states, offsets)
        x = torch.randn(t, conv_dim, dtype=dtype)
        weight = torch.randn(conv_dim, WIDTH, dtype=dtype)
        ops.causal_conv1d(x, weight, None, torch.zeros(b, conv_dim, WIDTH - 1), offsets)


def compile_for(arch: int) -> None:
    """Run in a child process without the interpreter: compile every kernel the fla
    backend launches for SM`arch` in fp16 and bf16; prints what was compiled as JSON."""
    import warnings

    import torch

    compiled = fake_gpu(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla.utils

    assert fla.utils.IS_NVIDIA, "fla did not take the stand-in card"
    assert fla.utils.IS_NVIDIA_HOPPER is (arch == 90)
    for dtype in (torch.float16, torch.bfloat16):
        run_ops(dtype)
    print(json.dumps(compiled))


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(CARDS))
def test_fla_kernels_compile_for_gpus(arch, tmp_path):
    """Each kernel the fla backend launches compiles for SM`arch` in fp16 and bf16, at
    least one config of each fits the card's shared memory, and the chunked kernels
    multiply on tensor cores."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed (pip install 'ninfer[fla]')")
    out = run_compile_script(f"import test_fla_compile as t; t.compile_for({arch})", tmp_path)
    compiled = json.loads(out.strip().splitlines()[-1])
    kernels: dict[tuple[str, tuple[str, ...]], list[dict]] = {}
    for row in compiled:
        kernels.setdefault((row["kernel"], tuple(row["dtypes"])), []).append(row)
    names = {name for name, _ in kernels}
    for want in (
        "fused_recurrent_gated_delta_rule_fwd_kernel",
        *MMA_KERNELS,
        "causal_conv1d_fwd_kernel",
        "causal_conv1d_update_kernel",
        "causal_conv1d_states_fwd_kernel",
    ):
        assert want in names, f"SM{arch}: {want} was not launched ({sorted(names)})"
    for (name, dtypes), rows in kernels.items():
        assert any(r["fits"] for r in rows), f"SM{arch}: no config of {name} {dtypes} fits"
        if name in MMA_KERNELS and ("*fp16" in dtypes or "*bf16" in dtypes):
            assert all(r["mma"] for r in rows), f"SM{arch}: {name} {dtypes} has no MMA"
