"""The `PackedLinear` contract: every layer `TorchOps.pack_linear` builds declares it
(subclasses `ninfer_core.model.ops.PackedLinear`), keeps its shape (`nbytes`, `w(x, b)`),
and `TorchOps.linear` runs any layer that declares it, not a list of known classes."""

from __future__ import annotations

import inspect

import pytest
import torch

from ninfer_core import conformance, plugin_types
from ninfer_core.kernels import cpu_gemv, reference
from ninfer_core.kernels.cpu_gemv import GemvLinear, Q4GemvLinear, Q8GemvLinear
from ninfer_core.kernels.onednn_linear import OneDNNLinear
from ninfer_core.kernels.reference import Int4Linear, TorchOps
from ninfer_core.model.ops import PackedLinear
from ninfer_core.quant.tensor import quantize

OUT, IN = 48, 64
_GEMV = pytest.mark.skipif(not cpu_gemv.available(), reason="CPU GEMV not built")


def _dense() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).bfloat16()


def _call_shape() -> inspect.Signature:
    """`PackedLinear.__call__` as the core calls it: `(x, b=None)`, without `self`."""
    sig = inspect.signature(plugin_types.PackedLinear.__call__)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


#: Each of the reference's packed layers, how to build it, and when it can be built here.
LAYERS = [
    pytest.param(GemvLinear, lambda: GemvLinear(_dense()), marks=_GEMV, id="GemvLinear"),
    pytest.param(
        Q4GemvLinear, lambda: Q4GemvLinear(quantize(_dense().float(), "Q4G32")),
        marks=_GEMV, id="Q4GemvLinear",
    ),
    pytest.param(
        Q8GemvLinear, lambda: Q8GemvLinear(quantize(_dense().float(), "W8G32")),
        marks=_GEMV, id="Q8GemvLinear",
    ),
    pytest.param(
        OneDNNLinear, lambda: OneDNNLinear(_dense()), id="OneDNNLinear",
        marks=pytest.mark.skipif(not reference._MKLDNN, reason="torch lacks oneDNN"),
    ),
    pytest.param(
        Int4Linear, lambda: Int4Linear(quantize(_dense().float(), "Q4G32")), id="Int4Linear",
        marks=pytest.mark.skipif(not reference._INT4_CPU, reason="no CPU int4 kernel"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "build"), LAYERS)
def test_each_packed_layer_keeps_the_contract(cls, build):
    layer = build()
    assert isinstance(layer, PackedLinear) and type(layer) is cls
    assert not conformance.problems(layer, plugin_types.PackedLinear)  # `nbytes`
    assert isinstance(layer.nbytes, int) and layer.nbytes > 0
    assert not conformance.call_problem("__call__", layer, _call_shape())
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(1)).bfloat16()
    b = torch.randn(OUT, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = TorchOps("cpu").linear(x, layer, b)
    assert y.shape == (3, OUT) and y.dtype == torch.bfloat16
    assert torch.equal(y, layer(x, b))


def test_linear_runs_any_layer_that_declares_the_contract():
    """A new packed layer needs no edit to `TorchOps.linear`: subclassing is enough."""

    class Doubled(PackedLinear):
        nbytes = 0

        def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            return 2 * x if b is None else 2 * x + b

    x = torch.ones(2, 4)
    assert torch.equal(TorchOps("cpu").linear(x, Doubled(), torch.ones(4)), 3 * x)
    # A dense weight still goes to `F.linear`.
    assert torch.equal(TorchOps("cpu").linear(x, torch.eye(4)), x)
