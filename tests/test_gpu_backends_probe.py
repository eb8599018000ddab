"""Which GPU backend serves each op, decided on this CPU machine: the real device (both
GPU backends refused, with their reasons) and simulated cards (`simulated_device`), per
op and per workload (weight formats, KV codec, compute dtype). No kernel runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer_core.cli.main import main
from ninfer_core.device import CudaInfo, DeviceInfo, probe_device, simulated_device
from ninfer_core.errors import UnsupportedChoiceError
from ninfer_core.kernels.compose import plan_kernels
from ninfer_core.kernels.workload import KernelWorkload
from ninfer_core.plugin_host import create_host
from ninfer_plugins.backend_cupy import table as cupy_table
from ninfer_plugins.backend_fla import table as fla_table
from ninfer_plugins.backend_triton import table as triton_table

ROOT = Path(__file__).resolve().parent.parent
CPU = probe_device(use_cuda=False)
TRITON_OPS = ("linear", "attention", "rms_norm", "rope", "silu_and_mul")
REFERENCE_OPS = ("gated_delta_rule", "causal_conv1d")
CUPY_MISSING = "CuPy is not installed (pip install 'ninfer[cupy]')"


def builtin_host():
    """Only the built-in plugins (no example or third-party backend in the ranking)."""
    return create_host(allowlist=[], warn=False)


def plan(device: DeviceInfo, workload: KernelWorkload, kernel: str | None = None):
    choices = plan_kernels(builtin_host(), device, "auto", kernel, workload=workload)
    return {c.op: c for c in choices}


def backends(choices) -> dict[str, str]:
    return {op: c.backend for op, c in choices.items()}


@pytest.fixture
def no_cupy(monkeypatch):
    """CuPy absent, whatever this machine has (the answer the tests below expect)."""
    monkeypatch.setattr(cupy_table, "cupy_installed", lambda: False)


@pytest.fixture
def with_cupy(monkeypatch):
    """CuPy present: a simulated card is answered from its spec, CuPy is not imported."""
    monkeypatch.setattr(cupy_table, "cupy_installed", lambda: True)


@pytest.fixture
def with_triton(monkeypatch):
    monkeypatch.setattr(triton_table, "triton_installed", lambda: True)


@pytest.fixture
def no_fla(monkeypatch):
    """fla-core absent: the Gated DeltaNet ops come from the reference."""
    monkeypatch.setattr(fla_table, "fla_installed", lambda: False)


@pytest.fixture
def with_fla(monkeypatch):
    """fla-core present: a simulated card is answered from its spec, fla is not imported."""
    monkeypatch.setattr(fla_table, "fla_installed", lambda: True)
    monkeypatch.setattr(fla_table, "triton_installed", lambda: True)


def test_on_this_cpu_machine_both_gpu_backends_are_refused_with_reasons(no_cupy, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    choices = plan(CPU, KernelWorkload(frozenset({"Q4G64", "fp32"}), "fp32", torch.float32))
    assert set(backends(choices).values()) == {"torch"}
    passed = dict(choices["linear"].passed_over)
    assert "no CUDA device" in passed["triton"] or "not installed" in passed["triton"]
    assert passed["cupy"] == CUPY_MISSING


def test_probe_prints_both_refusals_here(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "ninfer_core.cli.main", "probe"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=ROOT,
    ).stdout
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("  refused ")}
    assert "no CUDA device" in rows["triton"] or "Triton is not installed" in rows["triton"]
    if not cupy_table.cupy_installed():
        assert CUPY_MISSING in rows["cupy"]
    assert "linear: torch (reference)" in out and "passed over triton (" in out


@pytest.mark.parametrize("card", ["rtx3090", "h100"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_simulated_cards_get_triton_per_op_and_the_reference_for_delta_rule_ops(
    card, dtype, with_triton, no_cupy, no_fla
):
    workload = KernelWorkload(frozenset({"Q4G64", "Q6G64", "bf16"}), "int8", dtype)
    choices = plan(simulated_device(card), workload)
    assert backends(choices) == dict.fromkeys(TRITON_OPS, "triton") | dict.fromkeys(
        REFERENCE_OPS, "torch"
    )
    sm = simulated_device(card).cuda.sm_version
    assert f"SM{sm}" in choices["linear"].reason
    assert "highest priority providing it (20)" in choices["linear"].reason


@pytest.mark.parametrize("card", ["rtx3090", "h100"])
def test_simulated_cards_get_the_delta_rule_ops_from_fla_when_installed(
    card, with_triton, no_cupy, with_fla
):
    workload = KernelWorkload(frozenset({"Q4G64", "bf16"}), "fp16", torch.bfloat16)
    choices = plan(simulated_device(card), workload)
    assert backends(choices) == dict.fromkeys(TRITON_OPS, "triton") | dict.fromkeys(
        REFERENCE_OPS, "fla"
    )
    for op in REFERENCE_OPS:
        assert "highest priority providing it (15)" in choices[op].reason


def test_triton_refuses_bf16_on_an_sm75_card(with_triton, no_cupy):
    turing = DeviceInfo(CPU.cpu, CudaInfo("NVIDIA T4", (7, 5), 16 << 30, 15 << 30), "t4")
    bf16 = plan(turing, KernelWorkload(frozenset({"Q4G64", "bf16"}), "fp16", torch.bfloat16))
    assert set(backends(bf16).values()) == {"torch"}
    for op in TRITON_OPS:
        assert dict(bf16[op].passed_over)["triton"] == "bf16 needs SM80+, this is SM75"
    fp16 = plan(turing, KernelWorkload(frozenset({"Q4G64", "fp16"}), "fp16", torch.float16))
    assert backends(fp16)["linear"] == "triton"


def test_fp8_kv_gets_the_reference_attention_with_the_reason(with_triton, no_cupy):
    choices = plan(simulated_device("h100"), KernelWorkload(None, "fp8", torch.bfloat16))
    assert choices["attention"].backend == "torch"
    why = dict(choices["attention"].passed_over)["triton"]
    assert "no Triton attention for fp8 pages" in why
    assert choices["linear"].backend == "triton"
    assert (
        "passed over triton (no Triton attention for fp8 pages" in choices["attention"].describe()
    )


def test_a_format_triton_lacks_falls_to_cupy(with_triton, with_cupy, monkeypatch):
    """A Triton build without a Q5G64 kernel: CuPy (priority 10) serves linear, saying
    why Triton was passed over; the other ops stay Triton's."""
    monkeypatch.setattr(triton_table, "LINEAR_FORMATS", triton_table.LINEAR_FORMATS - {"Q5G64"})
    workload = KernelWorkload(frozenset({"Q4G64", "Q5G64", "fp16"}), "rk8v4", torch.float16)
    choices = plan(simulated_device("rtx3090"), workload)
    assert choices["linear"].backend == "cupy"
    assert "highest priority providing it (10)" in choices["linear"].reason
    assert dict(choices["linear"].passed_over)["triton"] == "no Triton GEMM for Q5G64 weights"
    assert backends(choices)["attention"] == "triton"
    # without CuPy the reference serves it, with both reasons
    monkeypatch.setattr(cupy_table, "cupy_installed", lambda: False)
    choices = plan(simulated_device("rtx3090"), workload)
    assert choices["linear"].backend == "torch"
    assert dict(choices["linear"].passed_over) == {
        "triton": "no Triton GEMM for Q5G64 weights",
        "cupy": CUPY_MISSING,
    }


def test_a_format_no_gpu_backend_reads_falls_to_the_reference(with_triton, with_cupy):
    workload = KernelWorkload(frozenset({"Q3G64", "fp16"}), "fp16", torch.float16)
    choices = plan(simulated_device("h100"), workload)
    assert choices["linear"].backend == "torch"
    passed = dict(choices["linear"].passed_over)
    assert "no Triton GEMM for Q3G64" in passed["triton"]
    assert "no CuPy GEMV for Q3G64" in passed["cupy"]


def test_forcing_cupy_where_it_is_missing_names_the_reason_and_alternatives(with_triton, no_cupy):
    with pytest.raises(UnsupportedChoiceError) as info:
        plan(simulated_device("rtx3090"), KernelWorkload(), kernel="linear=cupy")
    assert CUPY_MISSING in str(info.value) and "alternatives: torch, triton" in str(info.value)


def test_forcing_cupy_for_linear_when_present(with_triton, with_cupy):
    workload = KernelWorkload(frozenset({"Q4G32M", "bf16"}), "fp16", torch.bfloat16)
    choices = plan(simulated_device("a100"), workload, kernel="linear=cupy")
    assert backends(choices)["linear"] == "cupy"
    assert choices["linear"].reason.startswith("--kernel linear=cupy")
    assert backends(choices)["attention"] == "triton"


def test_probe_device_spec_prints_the_per_op_choices(with_triton, no_fla, capsys):
    assert main(["probe", "--device-spec", "rtx3090", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "kernel ops (which backend serves each, and why)" in out
    for op in TRITON_OPS:
        assert f"  {op}: triton - highest priority providing it (20)" in out
    for op in REFERENCE_OPS:
        assert f"  {op}: torch (reference)" in out
    assert main(["probe", "--device-spec", "rtx3090", "--dtype", "fp16", "--json"]) == 0
    ops = {c["op"]: c["backend"] for c in json.loads(capsys.readouterr().out)["kernel_ops"]}
    assert ops == dict.fromkeys(TRITON_OPS, "triton") | dict.fromkeys(REFERENCE_OPS, "torch")


def test_int8_activations_are_refused_by_cupy(with_cupy):
    workload = KernelWorkload(frozenset({"Q4G64", "fp16"}), "fp16", torch.float16, "int8")
    support = cupy_table.op_support(simulated_device("h100"), workload)["linear"]
    assert not support.ok and support.reason == "no CuPy kernels for int8 activations"


# ------------------------------------------------------------- bench/gpu_check.py

GPU_CHECK = ROOT / "bench" / "gpu_check.py"


def run_gpu_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), *args], capture_output=True, text=True, env=env
    )


def test_gpu_check_without_cuda_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = run_gpu_check("--quick")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()]
    assert done.stdout.startswith("no CUDA device: ")


def test_gpu_check_interpreted_checks_every_triton_op_against_the_reference():
    """`--interpret --quick`: the script's checks run on the CPU, the Triton kernels in
    the interpreter; every op Triton provides gets a row per dtype, within tolerance."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'ninfer[triton]')")
    done = run_gpu_check("--interpret", "--quick", "--backends", "torch,triton,cupy")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    errors: dict[tuple[str, str, str], list[float]] = {}
    for cells in rows:
        if len(cells) > 4 and cells[0] in ("torch", "triton") and cells[1] in TRITON_OPS:
            value = next(c for c in cells[3:] if c[0].isdigit() and "e" in c)
            errors.setdefault((cells[0], cells[1], cells[2]), []).append(float(value))
    for backend in ("torch", "triton"):
        for op in TRITON_OPS:
            for dtype in ("fp16", "fp32"):
                found = errors.get((backend, op, dtype))
                assert found, f"no {backend} {op} {dtype} row"
                assert max(found) <= {"fp16": 1e-2, "fp32": 1e-3}[dtype]
    assert len(errors[("triton", "linear", "fp16")]) == 8  # 3 formats + dense, T=1 and 20
    assert "backend cupy: refused: " in done.stdout
    assert "0 above tolerance" in done.stdout


def test_q6_k_codes_are_dequantized_at_load_on_the_gpu_backends(with_triton, with_cupy):
    """A Q4_K_M GGUF loads as Q4G32M and W8G16 (its Q6_K codes, a scale per 16 columns):
    no GPU kernel reads W8G16, so both GPU backends take the workload and dequantize those
    matrices once, at load, into the compute dtype, as the file loaded before its codes
    were kept; the planner is told the dense size. (Triton's packing:
    tests/test_triton_linear.py.)"""
    from ninfer_core.quant.tensor import quantize
    from ninfer_plugins.backend_cupy import linear as cupy_linear

    workload = KernelWorkload(frozenset({"Q4G32M", "W8G16", "fp32"}), "fp16", torch.bfloat16)
    choices = plan(simulated_device("rtx3090"), workload)
    assert choices["linear"].backend == "triton"
    choices = plan(simulated_device("rtx3090"), workload, kernel="linear=cupy")
    assert choices["linear"].backend == "cupy"
    w = quantize(torch.randn(48, 64), "W8G16")
    packed = cupy_linear.pack_linear(w, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(packed, w.dequantize(torch.bfloat16))
    assert cupy_linear.packed_nbytes("W8G16", (48, 64), torch.bfloat16) == 48 * 64 * 2
