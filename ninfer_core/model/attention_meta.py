"""`AttentionMetadata`: what every attention layer needs to know about one step's batch.

Built once per step on the host, before the layer loop, from the scheduled
`(sequence, n_new_tokens)` pairs; tokens of all sequences are flattened into one
varlen batch of T tokens. Host-side lists carry the sizes that shape tensors (so no
layer has to read a device value back), device tensors carry the indices.

It is the model's input, so it lives with the model: the engine builds it from its
sequences (anything shaped like `PagedSequence`), and the model never imports the engine.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class PagedSequence(Protocol):
    """What `AttentionMetadata.build` reads of a sequence (the engine's `Sequence`)."""

    seq_id: int
    #: Tokens whose K/V are already in the pool; this step's run from here.
    num_computed_tokens: int
    #: The pool pages holding its tokens, in order.
    block_table: list[int]

    def __len__(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PagedSpan:
    """A `PagedSequence` that is only that: `length` tokens, of which
    `num_computed_tokens` are in the store before this forward (a drafter's rows, a
    bench's or a test's made-up sequences)."""

    seq_id: int
    num_computed_tokens: int
    block_table: list[int]
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass
class AttentionMetadata:
    block_size: int
    #: New tokens per sequence this step, and context length after it (host ints).
    query_lens: list[int]
    context_lens: list[int]
    max_query_len: int
    max_context_len: int
    #: [B + 1] int32: sequence b's tokens are rows query_start_loc[b]:query_start_loc[b+1].
    query_start_loc: torch.Tensor
    #: [B] int32, context_lens on the device.
    context_lens_tensor: torch.Tensor
    #: [B, max_blocks] int32; rows shorter than max_blocks are padded with page 0.
    block_tables: torch.Tensor
    #: [T] int64: the flat KV slot (block * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    #: How many of the first sequences decode (a token, or a speculative round) rather
    #: than prefill a chunk, where the caller knows (the engine's runner); None: kernels
    #: that care tell them by their query lengths.
    leading_decodes: int | None = None
    #: Per-step state a kernel backend derives once in `KernelOps.prepare` (masks, ...).
    plan: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (the bandwidth-bound case)."""
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        batch: Seq[tuple[PagedSequence, int]],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        leading_decodes: int | None = None,
    ) -> AttentionMetadata:
        """Metadata for running `n` new tokens of each sequence after its computed ones.

        Each sequence's `block_table` must already cover its context (the engine's
        `BlockManager` sees to it).
        """
        query_lens, context_lens, slots, starts = [], [], [], [0]
        for seq, n in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if n <= 0 or end > len(seq):
                raise ValueError(f"cannot run tokens {start}:{end} of a {len(seq)}-token sequence")
            if end > len(seq.block_table) * block_size:
                raise ValueError(
                    f"sequence {seq.seq_id} has {len(seq.block_table)} blocks for {end} tokens"
                )
            table, bs = seq.block_table, block_size
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            starts.append(starts[-1] + n)
        max_blocks = max(-(-c // block_size) for c in context_lens)
        tables = [seq.block_table[:max_blocks] for seq, _ in batch]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            # Pinned host memory would let this copy overlap; plain copies are fine for now.
            return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

        return cls(
            block_size=block_size,
            query_lens=query_lens,
            context_lens=context_lens,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            query_start_loc=tensor(starts, torch.int32),
            context_lens_tensor=tensor(context_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            slot_mapping=tensor(slots, torch.int64),
            leading_decodes=leading_decodes,
        )
