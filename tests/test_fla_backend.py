"""The fla backend (`ninfer_plugins/backend_fla`): what it serves where, decided without
importing fla, and its ops against the torch reference (`ninfer_core/kernels/delta_rule.py`).

On this CPU machine only fla's fused recurrent kernel runs, in Triton's interpreter
(fp32): the chunked gated delta rule and the causal conv1d kernels are autotuned, and
Triton's autotuner times each config through a GPU driver, which fails with "0 active
drivers" even under TRITON_INTERPRET=1. Those run in the `gpu` tests below and in
`bench/gpu_check.py`; `test_fla_compile.py` compiles them for SM80, SM86 and SM90 here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ninfer_core.cli.main import main
from ninfer_core.device import probe_device, simulated_device
from ninfer_core.kernels import delta_rule as reference
from ninfer_core.kernels.compose import plan_kernels
from ninfer_core.kernels.workload import KernelWorkload
from ninfer_core.plugin_host import create_host
from ninfer_plugins.backend_fla import FlaBackend, table

OPS = ("gated_delta_rule", "causal_conv1d")
NO_AUTOTUNE_HERE = (
    "fla's chunked gated delta rule and causal conv1d kernels are autotuned: Triton's "
    "autotuner times each config through a GPU driver ('0 active drivers' here, even "
    "under TRITON_INTERPRET=1)"
)


@pytest.fixture
def with_fla(monkeypatch):
    """fla-core and Triton present: a simulated card is answered from its spec alone."""
    monkeypatch.setattr(table, "fla_installed", lambda: True)
    monkeypatch.setattr(table, "triton_installed", lambda: True)


def plan(device, workload=None):
    host = create_host(allowlist=[], warn=False)
    return {c.op: c for c in plan_kernels(host, device, "auto", workload=workload)}


# ------------------------------------------------------------------- what it serves


@pytest.mark.parametrize("card", ["rtx3090", "a100", "h100"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_simulated_ampere_and_newer_cards_get_both_ops_from_fla(card, dtype, with_fla):
    choices = plan(simulated_device(card), KernelWorkload(compute_dtype=dtype))
    for op in OPS:
        assert choices[op].backend == "fla", choices[op].describe()
        assert "highest priority providing it (15)" in choices[op].reason
    assert choices["linear"].backend != "fla"


def test_refusals_say_why(with_fla, monkeypatch):
    backend = FlaBackend()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = backend.supports(probe_device(use_cuda=False))
    assert not cpu.ok and "no CUDA device" in cpu.reason
    sm75 = dataclasses.replace(
        simulated_device("rtx3090"),
        cuda=dataclasses.replace(simulated_device("rtx3090").cuda, sm=(7, 5)),
    )
    old = backend.supports(sm75)
    assert not old.ok and "SM75 is older than SM80" in old.reason
    wide = backend.provides(
        simulated_device("h100"), workload=KernelWorkload(compute_dtype=torch.float64)
    )
    assert {op: s.ok for op, s in wide.items()} == dict.fromkeys(OPS, False)
    monkeypatch.setattr(table, "fla_installed", lambda: False)
    missing = backend.supports(simulated_device("h100"))
    assert not missing.ok and missing.reason == table.INSTALL_HINT


def test_probe_names_fla_for_the_two_ops_on_a_simulated_card(with_fla, capsys):
    assert main(["probe", "--device-spec", "rtx3090", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    for op in OPS:
        assert f"  {op}: fla - highest priority providing it (15)" in out


def test_importing_and_probing_never_imports_fla_or_triton():
    code = (
        "import sys, ninfer_plugins.backend_fla as b\n"
        "from ninfer_core.device import simulated_device\n"
        "b.FlaBackend().provides(simulated_device('h100'))\n"
        "print(','.join(m for m in ('fla', 'triton') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert done.stdout.strip() == ""


# ------------------------------------------------------------- the ops themselves


def interpreted_ops():
    """`FlaOps` on the CPU, fla's kernels in Triton's interpreter: only in a process
    started with TRITON_INTERPRET=1 (`run_interpreted`), since fla's kernels call
    Triton's own `@triton.jit` helpers (`tl.cdiv`), which must be interpreted too."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through run_interpreted"
    from ninfer_plugins.backend_fla.ops import FlaOps

    return FlaOps("cpu")


def run_interpreted(*checks: str) -> None:
    """Run this module's `checks` in a child Python under TRITON_INTERPRET=1; fails the
    test with the child's error."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'ninfer[fla]')")
    if importlib.util.find_spec("fla") is None:
        pytest.skip(table.INSTALL_HINT)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    calls = "; ".join(f"t.{c}()" for c in checks)
    done = subprocess.run(
        [sys.executable, "-c", f"import test_fla_backend as t; {calls}; print('ok')"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-4000:]


def delta_inputs(lengths, *, hqk=2, hv=4, dk=16, dv=32, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(sum(lengths) + len(lengths))
    t = sum(lengths)
    q, k = (torch.randn(t, hqk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = F.logsigmoid(torch.randn(t, hv, generator=gen) + 2)  # decays near 1, as trained
    beta = torch.rand(t, hv, generator=gen)
    states = 0.3 * torch.randn(len(lengths), hv, dk, dv, generator=gen)
    move = lambda x: x.to(device, dtype)  # noqa: E731
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return (*map(move, (q, k, v)), g.to(device), move(beta), states.to(device), offsets)


def check_against_reference(ops, lengths, tol, **shape):
    q, k, v, g, beta, states, offsets = delta_inputs(lengths, **shape)
    want_states = states.clone()
    want = reference.gated_delta_rule(q, k, v, g, beta, want_states, offsets)
    got = ops.gated_delta_rule(q, k, v, g, beta, states, offsets)
    assert got.dtype == v.dtype and got.shape == v.shape
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    assert (states - want_states).abs().max() <= tol * want_states.abs().max()


def test_fla_in_the_interpreter_matches_the_reference():
    """fla's fused recurrent kernel, interpreted, through `FlaOps`: the checks below."""
    run_interpreted("decode_rows_match", "mixed_step_routes_each_group", "float64_is_reference")


def decode_rows_match():
    """Sequences of 1 to 16 tokens, non-zero initial states, Hv = 2 Hqk: one fused
    recurrent launch over the whole step, states written back in place (fp32)."""
    check_against_reference(interpreted_ops(), [1, 3, 7, 2, 1], 1e-5)


def mixed_step_routes_each_group():
    """Short, long and empty sequences in one step: the short ones go to the fused
    recurrent kernel, the long ones to the chunked one (here stood in for by the
    recurrent kernel, which takes the same arguments and gives the same numbers), each
    group gathered out of the step and scattered back; an empty one's state stays."""
    ops = interpreted_ops()
    launched = []

    def chunk(q, k, v, g, beta, *, chunk_size, cu_seqlens_cpu, **kw):
        launched.append(("chunk", cu_seqlens_cpu.tolist(), chunk_size))
        return ops.kernels.recurrent(q, k, v, g=g, beta=beta, **kw)

    def recurrent(*args, cu_seqlens, **kw):
        launched.append(("recurrent", cu_seqlens.tolist()))
        return real(*args, cu_seqlens=cu_seqlens, **kw)

    real = ops.kernels.recurrent
    ops.kernels = dataclasses.replace(ops.kernels, chunk=chunk, recurrent=recurrent)
    check_against_reference(ops, [18, 2, 0, 5, 17], 1e-5)
    assert launched[0] == ("recurrent", [0, 2, 7])
    assert launched[1] == ("chunk", [0, 18, 35], 64)


def float64_is_reference():
    ops = interpreted_ops()
    check_against_reference(ops, [3, 20], 1e-12, dtype=torch.float64)


# ------------------------------------------------------------------ on a real GPU


def cuda_ops():
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device; {NO_AUTOTUNE_HERE}")
    if torch.cuda.get_device_capability()[0] < table.MIN_SM // 10:
        pytest.skip("fla's kernels serve SM80 or newer")
    if importlib.util.find_spec("fla") is None:
        pytest.skip(table.INSTALL_HINT)
    return FlaBackend().create_ops("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_delta_rule_on_a_gpu(dtype):
    """Prefill (chunked), decode (recurrent) and mixed steps at Qwen3.5's head sizes."""
    ops = cuda_ops()
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    shape = dict(hqk=4, hv=8, dk=128, dv=128, dtype=dtype, device="cuda")
    for lengths in ([1, 1, 1, 1], [3, 16, 1], [200, 64, 17], [1, 130, 0, 4, 65]):
        check_against_reference(ops, lengths, tol, **shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_conv1d_on_a_gpu(dtype):
    ops = cuda_ops()
    gen = torch.Generator().manual_seed(5)
    channels, width = 384, 4
    for lengths in ([1, 1, 1], [1, 70, 0, 3], [130, 2]):
        t = sum(lengths)
        x = torch.randn(t, channels, generator=gen).to("cuda", dtype)
        weight = torch.randn(channels, width, generator=gen).to("cuda", dtype)
        states = torch.randn(len(lengths), channels, width - 1, generator=gen).cuda()
        offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        want_states = states.clone()
        want = reference.causal_conv1d(x, weight, None, want_states, offsets)
        got = ops.causal_conv1d(x, weight, None, states, offsets)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
        assert torch.allclose(states, want_states, atol=1e-2 if dtype != torch.float32 else 0)
