"""Triton kernels on this CPU machine: imported under Triton's interpreter.

Triton decides at decoration time (`@triton.jit`, when a kernel module is imported)
whether a kernel runs compiled or interpreted, so `interpreted_module` imports the
backend's kernel modules with `TRITON_INTERPRET=1` set and then restores the
environment: the kernels stay interpreted for the whole test process, while backend
selection in other tests still sees a CPU machine that Triton refuses. The interpreter
computes bf16 wrongly; check the kernels in fp16 and fp32 (ENVIRONMENT.md).
"""

from __future__ import annotations

import importlib
import os
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
