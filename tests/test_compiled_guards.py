"""The compiled step keeps guards only on its inputs (`compile_graph(fixed=...)`): those on
the fixed arguments (the model, the KV store) and on globals are dropped, and a new batch
size still compiles a graph of its own."""

from __future__ import annotations

import types

import torch
from graph_helpers import count_traced

from ninfer_core.engine.compiled_step import (
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
        assert torch.allclose(fn(x), model.step(x), atol=1e-4), rows


class _Paged:
    """Fixed weights, and a table whose width changes from call to call (as the page
    table's page count does); two outputs, as the decode step returns several."""

    def __init__(self) -> None:
        self.weights = [torch.randn(16, 16) / 4 for _ in range(20)]

    def step(self, x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x * table.float().sum(1, keepdim=True), x.sum(1)


def _table(rows: int, width: int) -> torch.Tensor:
    table = torch.arange(rows * width, dtype=torch.int64).view(rows, width) % 7
    torch._dynamo.maybe_mark_dynamic(table, 1)
    return table


def test_calls_after_the_first_of_a_shape_skip_the_tracer_and_still_compute_each_call():
    model = _Paged()
    fn = compile_graph(own_code(model.step), fixed=("self",), dynamic={"table": 1})
    traced = count_traced(fn)
    for width in (2, 5, 3, 9):  # the dynamic dim: one graph, one traced call
        x, table = torch.randn(1, 16), _table(1, width)
        got, want = fn(x, table), model.step(x, table)
        assert all(torch.allclose(g, w, atol=1e-4) for g, w in zip(got, want, strict=True))
    assert len(traced) == 1
    for width in (4, 2):  # a new batch size: its own graph, traced once
        x, table = torch.randn(3, 16), _table(3, width)
        assert torch.allclose(fn(x, table)[0], model.step(x, table)[0], atol=1e-4)
    assert len(traced) == 2
    # A weight changed in place is read by the direct call (the same tensor object).
    model.weights[0].mul_(2)
    x, table = torch.randn(1, 16), _table(1, 6)
    assert torch.allclose(fn(x, table)[0], model.step(x, table)[0], atol=1e-4)
    assert len(traced) == 2


def test_arguments_in_other_layouts_go_through_the_tracer():
    model = _Paged()
    fn = compile_graph(own_code(model.step), fixed=("self",), dynamic={"table": 1})
    traced = count_traced(fn)
    for _ in range(3):
        x = torch.randn(16, 2).t()  # [2, 16], strided: not the layout a direct call takes
        table = _table(2, 4)
        assert torch.allclose(fn(x, table)[0], model.step(x, table)[0], atol=1e-4)
    assert len(traced) == 3


def test_without_fixed_arguments_every_call_goes_through_the_tracer():
    model = _Model()
    fn = compile_graph(own_code(model.step))
    traced = count_traced(fn)
    for _ in range(3):
        x = torch.randn(2, 16)
        assert torch.allclose(fn(x), model.step(x), atol=1e-4)
    assert len(traced) == 3
