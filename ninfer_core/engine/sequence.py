"""`Sequence`: one generation's tokens and where its KV lives."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated token ids, how many of them are in the KV cache, and the
    pages (block ids) that hold them, in order: token p lives in
    `block_table[p // block_size]` at offset `p % block_size`.

    The scheduler reads `max_tokens` (pages to reserve) and `deadline` (queue expiry); the
    block manager keeps the prefix-cache hash chain of the full blocks in `block_hashes`.
    """

    def __init__(
        self,
        token_ids: Iterable[int],
        seq_id: int | None = None,
        *,
        max_tokens: int = 0,
        deadline: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        #: Tokens whose K/V are already written to the cache.
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        #: New tokens this sequence may generate (what admission reserves pages for).
        self.max_tokens = max_tokens
        #: Engine-clock time after which it may no longer wait in the queue.
        self.deadline = deadline
        self.enqueued_at = 0.0
        self.status = SequenceStatus.WAITING
        #: Prompt tokens whose KV came from the prefix cache at admission.
        self.num_cached_tokens = 0
        #: Chain hashes of the full blocks already in the prefix cache (or matched from it).
        self.block_hashes: list[bytes] = []
        #: Chain hashes of the prompt's full blocks, computed once at the first admission try.
        self.prompt_hashes: list[bytes] | None = None
        #: Its prefix-cache chain starts from a root salted with this (None: the pool's root),
        #: so it shares blocks only with sequences of the same salt.
        self.cache_salt = cache_salt
        #: Its slot in the runtime's per-sequence state pool while it runs (a model with
        #: state layers); None otherwise.
        self.state_slot: int | None = None
        #: Tokens the state in `state_slot` has consumed (a model with state layers): the
        #: runner sets it after each forward, and a speculative round is verified with
        #: the state put back to the step's start (`engine/speculation.py`), so it never
        #: counts a draft the sequence did not keep, even for a request that ends inside a
        #: round; an end-of-request snapshot of the state is taken at this position. The
        #: block manager's reset of the computed count when the sequence ends leaves it.
        self.state_position = 0
        #: Draft tokens to follow `token_ids`, verified by the next step's forward
        #: (speculative decoding); never part of `token_ids` until the target accepts them.
        self.draft_ids: list[int] = []
        #: [len(draft_ids), vocab] draft distribution q of each draft; None: one-hot drafts.
        self.draft_probs = None
        #: Sequences it becomes once its prompt is done (a request's `n`, `engine/fanout.py`):
        #: admission reserves their slots and pages; 1 after the fork, and for any other.
        self.fan_out = 1
        #: An embedding request (`engine/pooling.py`): prefill only; it never resumes from
        #: the prefix cache (every token's hidden state is pooled), and the steps it runs
        #: in keep the final hidden states.
        self.embedding = False
        #: Its request's tenant and priority: the order in which the queue admits
        #: (`Scheduler.next_in_turn`).
        self.tenant: str | None = None
        self.priority = 0

    def __len__(self) -> int:
        """Tokens a forward may run: the accepted ones, then the drafts under verification."""
        return len(self.token_ids) + len(self.draft_ids)

    def run_ids(self, start: int, n: int) -> list[int]:
        """Token ids of positions `start:start + n`, drafts after the accepted tokens."""
        ids = self.token_ids[start : start + n]
        if len(ids) < n:
            first = max(0, start - len(self.token_ids))
            ids += self.draft_ids[first : first + n - len(ids)]
        return ids

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet run through the model (the rest of the prompt, or the last sample)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Some prompt tokens still lack K/V (so its logits are not sampled yet)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def max_length(self) -> int:
        """Prompt plus every token it may generate: the pages it can ever need."""
        return self.num_prompt_tokens + self.max_tokens

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
