"""The AVX512-BF16 decode GEMV (`ninfer_cpu::gemv_bf16`, built at run time) against float64
matmuls: ragged shapes, several rows, the prefill fallback, a compiled graph calling it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from ninfer_core.engine.compiled_step import compile_graph
from ninfer_core.kernels import cpu_gemv
from ninfer_core.kernels.cpu_gemv import GemvLinear
from ninfer_core.kernels.reference import TorchOps

pytestmark = pytest.mark.skipif(
    not cpu_gemv.available(), reason=f"CPU GEMV not built: {cpu_gemv.unavailable()}"
)


def _data(out: int, inp: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, inp, generator=g).to(torch.bfloat16)
    return w, x


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # fp32 sums rounded once to bf16: within bf16's half-ulp of each output, plus the
    # fp32 summation's own error (far smaller at these K).
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + 1e-3 * want.abs().max()).all(), err.max().item()


@pytest.mark.parametrize(
    ("rows", "out", "inp"),
    [(1, 960, 576), (1, 37, 33), (3, 100, 100), (8, 17, 64), (16, 576, 1536), (1, 9, 31)],
)
def test_gemv_is_the_matmul(rows, out, inp):
    w, x = _data(out, inp, rows)
    _check(cpu_gemv.gemv_bf16(x, w), x, w)


@pytest.mark.parametrize(("rows", "out", "inp"), [(1, 960, 576), (3, 37, 33), (16, 100, 1536)])
def test_the_fp32_gemv_is_the_matmul(rows, out, inp):
    w, x = (t.float() for t in _data(out, inp, rows, seed=3))
    got = cpu_gemv.gemv_f32(x, w)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == want.shape
    # fp32 sums of `inp` products: a few ulps of the largest partial sums
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-6 * (x.double().abs() @ w.double().abs().T).max().item(), err


def test_plain_fp32_weights_decode_on_the_fp32_gemv(monkeypatch):
    from ninfer_core.quant.tensor import quantize

    w, x = (t.float() for t in _data(64, 96, 17, seed=4))
    ops = TorchOps("cpu")
    assert ops.pack_linear(w) is w  # stays a plain tensor
    calls = []
    monkeypatch.setattr(cpu_gemv, "gemv_f32", lambda *a: calls.append(a) or a[0] @ a[1].T)
    want = x.double() @ w.double().T
    for rows in (1, 16, 17):
        with torch.inference_mode():
            got = ops.linear(x[:rows], w)
        assert torch.allclose(got.double(), want[:rows], rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # 17 rows (a prefill chunk) take F.linear
    q = quantize(w, "W8G32")
    dense = ops.pack_linear(q, dtype=torch.float32)  # dequantized once, then the GEMV
    assert torch.equal(dense, q.dequantize(torch.float32))
    with torch.inference_mode():
        ops.linear(x[:1], dense)
    assert len(calls) == 3
    grad_w = w.clone().requires_grad_()
    ops.linear(x[:1], grad_w)  # autograd needs torch's own matmul
    assert len(calls) == 3


def test_a_wrong_input_is_refused_with_the_reason():
    w, x = _data(8, 32, 1)
    with pytest.raises(RuntimeError, match="bf16 only"):
        cpu_gemv.gemv_bf16(x.float(), w.float())
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\]"):
        cpu_gemv.gemv_bf16(x[:, :16], w)


def test_the_linear_takes_the_gemv_for_decode_and_f_linear_for_prefill(monkeypatch):
    w, x = _data(48, 80, GemvLinear.MAX_ROWS + 4, seed=2)
    b = torch.randn(48).to(torch.bfloat16)
    lin = TorchOps("cpu").pack_linear(w)
    assert isinstance(lin, GemvLinear) and lin.weight.data_ptr() == w.data_ptr()  # no copy
    calls = []
    real = cpu_gemv.gemv_bf16
    monkeypatch.setattr(cpu_gemv, "gemv_bf16", lambda *a: calls.append(1) or real(*a))
    _check(lin(x[:1]), x[:1], w)
    _check(lin(x[: GemvLinear.MAX_ROWS]), x[: GemvLinear.MAX_ROWS], w)
    assert len(calls) == 2
    _check(lin(x), x, w)  # more rows: a dense GEMM
    assert len(calls) == 2
    got = lin(x[:2], b)
    want = x[:2].double() @ w.double().T + b.double()
    assert (got.double() - want).abs().max().item() <= 0.02 * want.abs().max().item()
    assert lin.nbytes == w.numel() * 2 and lin.shape == w.shape


def test_a_compiled_graph_calls_the_operator():
    w, x = _data(40, 96, 2, seed=3)
    lin = GemvLinear(w)

    def fn(x):
        return torch.relu(lin(x * 2)) + 1

    got = compile_graph(fn)(x)  # as the decode step compiles
    assert torch.equal(got, fn(x))


def test_compiled_graphs_are_cached_per_build_of_the_operators():
    """Inductor's graph cache keys on the graph, not on the operators' code: a graph
    compiled against an older schema of `gemv_q4` would call it with the wrong
    arguments. The key takes a digest of the sources, so changing them misses the cache."""
    digest = hashlib.sha256()
    for source in cpu_gemv._SOURCES:
        digest.update(Path(source).read_bytes())
    digest.update(" ".join(cpu_gemv._FLAGS).encode())
    tags = torch.compiler.config.cache_key_tag.split()
    assert f"ninfer_cpu-{digest.hexdigest()[:16]}" in tags
    cpu_gemv._key_compiled_graphs()  # once only, however often the library is checked
    assert torch.compiler.config.cache_key_tag.split() == tags


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("NINFER_CPU_GEMV", "0")
    cpu_gemv.unavailable.cache_clear()
    try:
        assert cpu_gemv.unavailable() == "NINFER_CPU_GEMV=0" and not cpu_gemv.available()
    finally:
        monkeypatch.delenv("NINFER_CPU_GEMV")
        cpu_gemv.unavailable.cache_clear()
        assert cpu_gemv.available()


def test_the_build_folder_is_the_sources_own_and_a_stale_lock_is_removed(tmp_path, monkeypatch):
    """Two checkouts with other sources never share a build; a lock a killed build left
    behind is removed instead of waited on forever, a live one is kept."""
    import os
    import time

    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpu_gemv._build_directory(cpp_extension)
    assert folder.parent == tmp_path and folder.name.startswith(cpu_gemv._sources_tag())
    lock = folder / "lock"
    lock.touch()
    assert cpu_gemv._build_directory(cpp_extension) == folder and lock.exists()  # live
    old = time.time() - cpu_gemv.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert cpu_gemv._build_directory(cpp_extension) == folder and not lock.exists()
    monkeypatch.setattr(cpu_gemv, "_FLAGS", [*cpu_gemv._FLAGS, "-DOTHER"])
    assert cpu_gemv._build_directory(cpp_extension) != folder  # other flags: another build
