"""Triton kernels on this CPU machine: imported under Triton's interpreter.

Triton decides at decoration time (`@triton.jit`, when a kernel module is imported)
whether a kernel runs compiled or interpreted, so `interpreted_module` imports the
backend's kernel modules with `TRITON_INTERPRET=1` set and then restores the
environment: the kernels stay interpreted for the whole test process, while backend
selection in other tests still sees a CPU machine that Triton refuses. The interpreter
computes bf16 wrongly; check the kernels in fp16 and fp32 (ENVIRONMENT.md).

The interpreter also accepts code that Triton's compiler refuses, so each kernel
module's tests compile its kernels for real GPUs too: `run_compile_script` runs a script
in a child process that imports the kernels compiled, and the script calls
`compile_for_gpu` for each variant.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import ModuleType

import pytest


def interpreted_module(name: str) -> ModuleType:
    """`name` (a `ninfer_plugins.backend_triton` module) with its kernels interpreted;
    skips the test where Triton is not installed."""
    # Triton itself is imported first, compiled: its own library must not be half
    # interpreted (the kernels call only language builtins, which work either way).
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'ninfer[triton]')")
    if name in sys.modules:
        return sys.modules[name]
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(name)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


# Compiled for real GPUs, in a process without the interpreter: the interpreter runs
# Python that Triton's compiler would refuse (and says nothing about tensor cores or
# register pressure). ptxas ships with Triton, so no GPU is needed.


def compile_for_gpu(
    kernel,
    signature: dict[str, str],
    constexprs: dict[str, object],
    arch: int,
    *,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """`kernel` (a `@triton.jit` function, imported compiled) compiled to a cubin for
    CUDA SM`arch`. `signature` types the runtime arguments ("*fp16", "i32", "fp32");
    the `constexprs` are added to it as such."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    while not isinstance(kernel, triton.runtime.JITFunction):  # autotuned: its kernel
        kernel = kernel.fn
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    missing = [a for a in kernel.arg_names if a not in sig]
    assert not missing, f"{kernel.__name__}: untyped arguments {missing}"
    src = ASTSource(kernel, sig, dict(constexprs))
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def run_compile_script(script: str, cache_dir: os.PathLike) -> str:
    """Run `script` in a fresh Python without `TRITON_INTERPRET` (so `@triton.jit`
    kernels are imported compiled), able to import this module; its stdout. Fails the
    test with the script's error where it exits non-zero."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'ninfer[triton]')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    path = [here, os.path.dirname(here), env.get("PYTHONPATH", "")]
    env.update(
        TRITON_CACHE_DIR=str(cache_dir),
        TRITON_DEFAULT_FP_FUSION="1",
        PYTHONPATH=os.pathsep.join(p for p in path if p),
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
