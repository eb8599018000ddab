"""Issue 13 item 18: CPU threads must degrade gracefully when the machine is busy.

GNU OpenMP's default spin-wait made two torch threads ~5-50x slower beside two busy
processes on 2 cores (`ninfer bench threads`, docs/performance.md); not spinning at all
(`OMP_WAIT_POLICY=PASSIVE`) made them 2.6x slower on a quiet machine; a bounded spin
(`GOMP_SPINCOUNT=10000`) is close to the best of both. OpenMP reads it once, when torch
loads it, so the entry points set it (with the kernel cache capacities) in
`ninfer_core/cli/__init__.py`, before anything imports torch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from ninfer_core.device import (
    CPU_RUNTIME_ENV,
    configure_cpu_runtime,
    kernel_cache_capacity,
    thread_summary,
)

CLEAN = {k: v for k, v in os.environ.items() if k not in CPU_RUNTIME_ENV}


def child(code: str) -> str:
    """Run `code` in a fresh interpreter without any of the variables set."""
    return subprocess.run(
        [sys.executable, "-c", code], env=CLEAN, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_defaults_fill_only_what_the_user_left_unset():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    chosen = configure_cpu_runtime(env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and "OMP_WAIT_POLICY" not in chosen
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == env["LRU_CACHE_CAPACITY"] == "128"
    assert configure_cpu_runtime(env) == {}  # a second call changes nothing
    assert "GOMP_SPINCOUNT" not in env  # a chosen policy is not mixed with a spin count
    spin = {"GOMP_SPINCOUNT": "300000"}  # GNU OpenMP's own default, chosen explicitly
    configure_cpu_runtime(spin)
    assert spin["GOMP_SPINCOUNT"] == "300000" and "OMP_WAIT_POLICY" not in spin
    assert spin["LRU_CACHE_CAPACITY"] == "128"


def test_kernel_cache_capacity_reads_the_environment():
    assert kernel_cache_capacity({}) == 1024  # oneDNN's and ideep's own default
    assert kernel_cache_capacity({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}) == 1024
    both = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "32"}
    assert kernel_cache_capacity(both) == 64
    assert kernel_cache_capacity({**both, "LRU_CACHE_CAPACITY": "lots"}) == 1024


def test_both_entry_points_set_a_bounded_spin_before_torch_loads():
    """Importing the CLI package sets the spin count and imports no torch; each entry
    point's module then sees it (ninfer-serve's module imports torch at the top)."""
    code = (
        "import os, sys; import ninfer_core.cli; "
        "print('torch' in sys.modules, os.environ['GOMP_SPINCOUNT'], "
        "os.environ.get('OMP_WAIT_POLICY'), os.environ['LRU_CACHE_CAPACITY'])"
    )
    assert child(code) == "False 10000 None 128"
    for module in ("ninfer_core.cli.main", "ninfer_core.cli.serve"):
        code = f"import os, {module}; print(os.environ['GOMP_SPINCOUNT'])"
        assert child(code) == "10000"


def test_thread_summary_names_count_and_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    line = thread_summary()
    assert (
        line == f"torch threads: {torch.get_num_threads()} (GOMP_SPINCOUNT=10000: spin, then sleep)"
    )
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert thread_summary().endswith("(OMP_WAIT_POLICY=PASSIVE)")
