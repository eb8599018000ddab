"""The compiled step keeps guards only on its inputs (`compile_graph(fixed=...)`): those on
the fixed arguments (the model, the KV store) and on globals are dropped, and a new batch
size still compiles a graph of its own."""

from __future__ import annotations

import types

import torch

from ninfer_core.engine.compiled_step import (
    call_graph,
    compile_graph,
    fixed_guards_dropped,
    own_code,
)


def _entry(name: str, is_global: bool = False):
    return types.SimpleNamespace(name=name, is_global=is_global)


def test_guards_on_fixed_arguments_and_globals_are_dropped():
    names = ["self", "self.layers[0].w", "kv_store.pools[1]", "self_x", "x", "table", ""]
    # Sources inside calls: the code a layer's type runs, a property's getter.
    names += ["type(self.layers[0].mlp).__call__", "dict(type(self.embed).__dict__)['f'].fget",
              "type(x).__call__", "len(table)"]  # fmt: skip
    keep = fixed_guards_dropped(frozenset({"self", "kv_store"}), [_entry(n) for n in names])
    assert keep == [False, False, False, True, True, True, True, False, False, True, True]
    assert fixed_guards_dropped(frozenset(), [_entry("torch", is_global=True)]) == [False]


class _Model:
    def __init__(self) -> None:
        self.weights = [torch.randn(16, 16) / 4 for _ in range(50)]

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x


def test_a_step_with_fixed_arguments_still_tells_batch_sizes_apart():
    model = _Model()
    fn = compile_graph(own_code(model.step), fixed=("self",))
    for rows in (1, 3, 1, 3):
        x = torch.randn(rows, 16)
        assert torch.allclose(call_graph(fn, x), model.step(x), atol=1e-4), rows
