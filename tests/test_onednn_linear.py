"""`OneDNNLinear`: a dense bf16 weight in oneDNN's packed layout, called eagerly and from a
compiled graph (through the `ninfer::onednn_linear` op), against float64 matmuls."""

from __future__ import annotations

import gc

import pytest
import torch

from ninfer_core.engine.compiled_step import compile_graph
from ninfer_core.kernels import cpu_gemv, onednn_linear
from ninfer_core.kernels.onednn_linear import OneDNNLinear
from ninfer_core.kernels.reference import TorchOps

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN"
)


def _data(out: int, inp: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, inp, generator=g).to(torch.bfloat16)
    b = torch.randn(out, generator=g).to(torch.bfloat16)
    return w, x, b


def _reference(x, w, b=None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).abs().max().item()
    assert err <= 2e-2 * want.abs().max().item(), err  # bf16 output: 8 bits


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_eager_call_is_the_matmul(rows):
    w, x, b = _data(72, 96, rows)
    lin = OneDNNLinear(w)
    _close(lin(x), _reference(x, w))
    _close(lin(x, b), _reference(x, w, b))
    assert lin.shape == w.shape and lin.nbytes == w.numel() * 2
    assert torch.equal(lin.packed.to_dense(), w)  # the reorder kept every value


def test_the_reference_ops_pack_dense_bf16_into_it_without_the_gemv(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "available", lambda: False)  # no AVX512-BF16 GEMV
    ops = TorchOps("cpu")
    w, x, _ = _data(40, 64, 2)
    packed = ops.pack_linear(w)
    assert isinstance(packed, OneDNNLinear)
    _close(ops.linear(x, packed), _reference(x, w))
    assert not isinstance(ops.pack_linear(w.float()), OneDNNLinear)  # fp32 stays plain


def test_a_compiled_graph_calls_the_same_kernel():
    w, x, b = _data(48, 64, 2, seed=1)
    lin = OneDNNLinear(w)

    def fn(x, b):
        return torch.relu(lin(x * 2, b)) + 1

    got = compile_graph(fn)(x, b)  # as the decode step compiles
    assert torch.equal(got, fn(x, b))  # same oneDNN call on the same packed weight
    _close(got, torch.relu(_reference(x * 2, w, b)) + 1)


def test_the_slot_is_freed_with_the_weight():
    w, _, _ = _data(16, 32, 1)
    lin = OneDNNLinear(w)
    slot = lin.slot
    assert onednn_linear._WEIGHTS[slot] is lin.packed
    del lin
    gc.collect()
    assert slot not in onednn_linear._WEIGHTS
