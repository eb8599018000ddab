"""What each layer of a model keeps between steps: K/V per token, or a state per sequence.

A model family declares it per layer (`ModelFamily.layer_caches`), from the config alone, so
the memory planner can size it before a weight is loaded and the runtime can allocate it:

- `PagedKV`: attention keeps the K and V of every token, in pages of the shared pool; the
  cost grows with the context.
- `SequenceState`: a layer keeps a fixed-size state per running sequence (a linear-attention
  layer's recurrent state, a causal convolution's last columns); the cost grows with the
  number of sequences, not with their length.

Dense models declare `PagedKV` for every layer (`dense_caches`), which is what a family that
declares nothing gets. Paged layers are numbered in the KV pool in layer order
(`ModelCaches.kv_index`): a hybrid model's pool holds only its attention layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ninfer_core.model.config import ModelConfig
    from ninfer_core.plugin_types import ModelFamily


@dataclass(frozen=True, slots=True)
class PagedKV:
    """K and V per token, `num_kv_heads` heads of `head_dim`, in the paged pool."""

    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One tensor of a per-sequence state: its name, shape (without the sequence) and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A fixed-size state per running sequence, zero when the sequence starts."""

    tensors: tuple[StateTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


LayerCache = PagedKV | SequenceState


@dataclass(frozen=True)
class ModelCaches:
    """Every layer's cache, in layer order."""

    layers: tuple[LayerCache, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model declares the cache of at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, PagedKV | SequenceState):
                raise TypeError(f"layer {i}: {layer!r} is neither PagedKV nor SequenceState")
            if isinstance(layer, SequenceState) and not layer.tensors:
                raise ValueError(f"layer {i}: a SequenceState needs at least one tensor")
        geometries = {(c.num_kv_heads, c.head_dim) for c in self.paged}
        if len(geometries) > 1:
            raise ValueError(
                f"paged layers of different geometries {sorted(geometries)}: the KV pool "
                "holds one (num_kv_heads, head_dim)"
            )

    @property
    def paged(self) -> list[PagedKV]:
        return [c for c in self.layers if isinstance(c, PagedKV)]

    @property
    def paged_layers(self) -> list[int]:
        """Model layer indices that keep K/V in the pool, in pool order."""
        return [i for i, c in enumerate(self.layers) if isinstance(c, PagedKV)]

    @property
    def state_layers(self) -> dict[int, SequenceState]:
        """Model layer index -> its per-sequence state."""
        return {i: c for i, c in enumerate(self.layers) if isinstance(c, SequenceState)}

    @property
    def has_state(self) -> bool:
        return any(isinstance(c, SequenceState) for c in self.layers)

    @property
    def state_bytes_per_sequence(self) -> int:
        """One sequence's state over every layer (what each running sequence costs)."""
        return sum(c.nbytes for c in self.state_layers.values())

    @property
    def kv_geometry(self) -> PagedKV | None:
        """The one geometry of the paged layers; None when no layer keeps per-token K/V."""
        paged = self.paged
        return paged[0] if paged else None

    def kv_index(self, layer: int) -> int:
        """The pool's layer number for model layer `layer` (which must be paged)."""
        if not isinstance(self.layers[layer], PagedKV):
            raise ValueError(f"layer {layer} keeps a per-sequence state, not paged K/V")
        return self.paged_layers.index(layer)


def dense_caches(config: ModelConfig) -> ModelCaches:
    """Paged K/V in every layer: a dense decoder, and any family that declares nothing."""
    kv = PagedKV(config.num_kv_heads, config.head_dim)
    return ModelCaches(tuple(kv for _ in range(config.num_layers)))


def caches_for(family: ModelFamily | None, config: ModelConfig) -> ModelCaches:
    """The caches `family` declares for `config` (`ModelFamily.layer_caches`), checked;
    the dense layout when it declares none (or there is no family: a test's bare model)."""
    declare = family.layer_caches if family is not None else None
    caches = dense_caches(config) if declare is None else declare(config)
    if not isinstance(caches, ModelCaches):
        raise TypeError(f"layer_caches of {family!r} returned {caches!r}, not a ModelCaches")
    if len(caches.layers) != config.num_layers:
        raise ValueError(
            f"layer_caches of {family!r} declares {len(caches.layers)} layers; "
            f"the config has {config.num_layers}"
        )
    return caches
