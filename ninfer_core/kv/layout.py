"""`KVLayout`: the shape of the paged KV pool, independent of how it is encoded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How many pages of how many token slots, for which attention geometry."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def num_slots(self) -> int:
        """Token capacity of the whole pool (all sequences together)."""
        return self.num_blocks * self.block_size

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) pool: `[num_blocks, block_size, Hkv, D]`."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
