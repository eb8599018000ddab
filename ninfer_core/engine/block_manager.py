"""`BlockManager`: hands out KV pages to sequences and takes them back."""

from __future__ import annotations

from collections import deque

from ninfer_core.engine.sequence import Sequence
from ninfer_core.errors import NInferError


class OutOfBlocksError(NInferError):
    """`allocate` was asked for more pages than are free (call `can_allocate` first)."""


class BlockManager:
    """A free list of `num_blocks` pages of `block_size` tokens (no prefix sharing yet)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, n_tokens: int) -> int:
        """New pages `seq` needs to hold `n_tokens` more tokens after its computed ones."""
        total = seq.num_computed_tokens + n_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, n_tokens: int) -> bool:
        return self.blocks_needed(seq, n_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, n_tokens: int) -> None:
        """Grow `seq.block_table` to cover `n_tokens` more tokens; a no-op when it does."""
        need = self.blocks_needed(seq, n_tokens)
        if need > len(self._free):
            raise OutOfBlocksError(
                f"sequence {seq.seq_id} needs {need} KV blocks, only {len(self._free)} free"
            )
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Return every page of `seq`; its cache is gone, so it restarts from token 0."""
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
