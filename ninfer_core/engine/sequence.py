"""`Sequence`: one generation's tokens and where its KV lives."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

_ids = itertools.count()


class Sequence:
    """Prompt plus generated token ids, how many of them are in the KV cache, and the
    pages (block ids) that hold them, in order: token p lives in
    `block_table[p // block_size]` at offset `p % block_size`."""

    def __init__(self, token_ids: Iterable[int], seq_id: int | None = None) -> None:
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        #: Tokens whose K/V are already written to the cache.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet run through the model (the rest of the prompt, or the last sample)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
