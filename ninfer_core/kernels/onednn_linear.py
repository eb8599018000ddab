"""`OneDNNLinear`: a dense weight in oneDNN's packed (blocked) layout, callable eagerly and
from a compiled graph.

`TorchOps.pack_linear` reorders dense bf16 weights on the CPU into oneDNN's layout once at
load: decode GEMVs then stream the weight at close to memory bandwidth, about 1.5-3x
`F.linear` over the row-major matrix. A tensor in that layout is opaque to the compiler
(`torch.compile` cannot trace it: it has no strides), so the weight is held here and
reached from a graph through one custom op, `ninfer::onednn_linear`, that names it by a
slot number. The graph then calls oneDNN's packed GEMM on the very tensor the eager path
uses: no second, compiler-packed copy of the weights (inductor's `freezing` would keep
one), and the same numbers in both paths.

The slot table holds the only reference besides this object's; it is freed with the
object (`weakref.finalize`).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ninfer_core.model.ops import PackedLinear

#: Packed weights by slot; an entry lives as long as its `OneDNNLinear`.
_WEIGHTS: dict[int, torch.Tensor] = {}
_SLOTS = itertools.count()

_LIB = torch.library.Library("ninfer", "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, int slot, int out_features, Tensor? bias) -> Tensor")


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")


def _onednn_linear_cpu(
    x: torch.Tensor, slot: int, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    return _packed_linear(x, _WEIGHTS[slot], bias)


def _onednn_linear_fake(
    x: torch.Tensor, slot: int, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


# Registered on the backend key directly (not `torch.library.custom_op`): a call from the
# compiled graph's wrapper then costs one dispatch and no Python autograd layer.
_LIB.impl("onednn_linear", _onednn_linear_cpu, "CPU")
torch.library.register_fake("ninfer::onednn_linear", _onednn_linear_fake, lib=_LIB)


class OneDNNLinear(PackedLinear):
    """A dense `[out, in]` weight reordered into oneDNN's layout; `self(x, b)` is
    `F.linear(x, w, b)` with the same result in bf16."""

    def __init__(self, w: torch.Tensor) -> None:
        self.out_features, self.in_features = (int(n) for n in w.shape)
        self.dtype = w.dtype
        self.nbytes = w.numel() * w.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())
        self.slot = next(_SLOTS)
        _WEIGHTS[self.slot] = self.packed
        weakref.finalize(self, _WEIGHTS.pop, self.slot, None)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.ninfer.onednn_linear(x, self.slot, self.out_features, b)
        return _packed_linear(x, self.packed, b)

    def __repr__(self) -> str:
        return f"OneDNNLinear([{self.out_features}, {self.in_features}], {self.dtype})"
