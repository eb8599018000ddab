"""Quantizing a checkpoint's dense matrices while it loads (`--recipe`).

A 27B hybrid in bf16 holds 50 GiB of weights; the 24 GiB card the deployment guide runs it
on holds it only at about 4.5 bits a weight. `ninfer convert --recipe` writes such a file
once; `--recipe` on `ninfer-serve` (and `ninfer plan`) does the same conversion in memory,
so a Hugging Face folder serves on a card its dense weights do not fit. `QuantizingArtifact`
is the artifact as the conversion would have stored it: each dense 2-D tensor the recipe
quantizes is named in the recipe's format (`tensor_format`, headers only, so the memory
plan and the kernel selection see the formats that will run) and handed out as that
format's codes (`load_weight`, by `quant.tensor.quantize`: the codes `ninfer convert`
writes, bit for bit). Tensors the source already stores quantized (a GGUF's blocks, a
`.ninfer`'s codes) keep their codes, as `convert` keeps them.

`--recipe auto` (the default) keeps the checkpoint's precision whenever the memory plan
fits with it, and quantizes by `AUTO_RECIPE` only when it does not and that does fit:
`cli/plan_cmd.py` decides, and says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ninfer_core.plugin_types import Artifact
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.recipes import Recipe, recipe

#: `--recipe auto` when the checkpoint's own precision does not fit.
AUTO_RECIPE = "mixed"
#: `--recipe` values that are not recipes: keep the checkpoint's precision.
KEEP = ("auto", "none")


class QuantizingArtifact:
    """`inner` with the dense matrices `recipe` quantizes handed out quantized."""

    def __init__(self, inner: Artifact, plan: Recipe) -> None:
        self.inner, self.recipe = inner, plan
        self.path = inner.path
        self.tensor_file = inner.tensor_file
        self.object_table = inner.object_table  # sizes of what it stores quantized already
        if inner.with_components is not None:
            self.with_components = self._with_components

    with_components: Any = None

    @property
    def config(self) -> dict[str, Any]:
        return self.inner.config

    def tensor_names(self) -> list[str]:
        return self.inner.tensor_names()

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.inner.tensor_shape(name)

    def load_tensor(self, name: str) -> torch.Tensor:
        return self.inner.load_tensor(name)

    def read_text(self, name: str) -> str | None:
        return self.inner.read_text(name)

    def _stored_format(self, name: str) -> str:
        return (self.inner.tensor_format(name) if self.inner.tensor_format else "") or ""

    def tensor_format(self, name: str) -> str:
        """The recipe's format where it quantizes a matrix the source stores dense; the
        source's own format ("" for a dense tensor of a folder) everywhere else."""
        stored = self._stored_format(name)
        if stored and weight_format(stored).quantized:
            return stored
        shape = self.inner.tensor_shape(name)
        if len(shape) != 2:
            return stored
        fmt = self.recipe.format_for(name, shape, torch.float32)
        return fmt if weight_format(fmt).quantized else stored

    def load_weight(self, name: str) -> Any:
        """A `QuantizedTensor` where `tensor_format` quantizes, else the source's weight."""
        from ninfer_core.quant.tensor import quantize

        fmt = self.tensor_format(name)
        if fmt and weight_format(fmt).quantized and fmt != self._stored_format(name):
            return quantize(self.inner.load_tensor(name), fmt)
        load = self.inner.load_weight or self.inner.load_tensor
        return load(name)

    @contextlib.contextmanager
    def _with_components(self, names: Iterable[str]) -> Iterator[QuantizingArtifact]:
        assert self.inner.with_components is not None
        with self.inner.with_components(names) as full:
            yield QuantizingArtifact(full, self.recipe)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def quantizes(artifact: Artifact, plan: Recipe) -> bool:
    """Whether `plan` quantizes any matrix of `artifact` (one the source stores dense)."""
    view = QuantizingArtifact(artifact, plan)
    return any(
        view.tensor_format(name) != view._stored_format(name) for name in artifact.tensor_names()
    )


def with_recipe(artifact: Artifact, name: str | None) -> Artifact:
    """`artifact` as `--recipe name` loads it: itself for None, `auto` or `none`."""
    if name is None or name in KEEP:
        return artifact
    return QuantizingArtifact(artifact, recipe(name))
