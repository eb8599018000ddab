"""`BlockManager`: hands out KV pages to sequences, shares full ones, and takes them back."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from ninfer_core.engine.prefix_cache import PrefixCache, chain_hashes, salted_root
from ninfer_core.engine.sequence import Sequence
from ninfer_core.errors import NInferError


class OutOfBlocksError(NInferError):
    """`allocate` was asked for more pages than are free (call `can_allocate` first)."""


class BlockManager:
    """`num_blocks` pages of `block_size` tokens, each in exactly one state:

    - *free*: no holder, nothing worth keeping;
    - *held*: its reference count is the number of sequences whose block table holds it;
    - *idle*: no holder, but indexed by the prefix cache, so a later prompt with the same
      prefix takes it back instead of recomputing it; evicted least recently released first
      when the free list runs dry.

    Only full blocks whose K/V are computed are ever indexed, and a sequence writes only past
    its computed tokens, so a shared page is never written again. With
    `enable_prefix_cache=False` nothing is indexed and freed pages go straight back.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_cache: bool = False,
        salt: str = "",
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        #: The key each page is indexed under in the prefix cache (None: not indexed).
        self._keys: list[bytes | None] = [None] * num_blocks
        #: `salt` names what else changes a block's bytes (the KV codec); see prefix_cache.py.
        self.cache = PrefixCache(salt) if enable_prefix_cache else None

    @property
    def num_free_blocks(self) -> int:
        """Pages `allocate` can hand out: free ones plus idle cached ones it would evict."""
        return len(self._free) + (self.cache.num_idle if self.cache else 0)

    @property
    def num_used_blocks(self) -> int:
        """Pages held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Pages indexed by the prefix cache, held or idle."""
        return len(self.cache) if self.cache else 0

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, n_tokens: int) -> int:
        """New pages `seq` needs to hold `n_tokens` more tokens after its computed ones."""
        total = seq.num_computed_tokens + n_tokens
        return max(0, self.blocks_for(total) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, n_tokens: int) -> bool:
        return self.blocks_needed(seq, n_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, n_tokens: int) -> None:
        """Grow `seq.block_table` to cover `n_tokens` more tokens; a no-op when it does."""
        need = self.blocks_needed(seq, n_tokens)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq.seq_id} needs {need} KV blocks, only {self.num_free_blocks} free"
            )
        seq.block_table.extend(self._take() for _ in range(need))

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # reuse the idle cached page released longest ago
            block = self.cache.evict()
            self._keys[block] = None
        self._refs[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Let go of every page of `seq`; it restarts from token 0 if it ever runs again.

        Pages go back last block first, so under pressure a prefix's tail is evicted before
        its head (a head is useful alone, a tail never is).
        """
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                key = self._keys[block]
                if key is None:
                    self._free.append(block)
                else:
                    self.cache.release(block, key)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.block_hashes = []

    def share_prompt(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (holding nothing) `parent`'s computed full pages by reference and a
        fresh page for its partial last one (a fork, `engine/fanout.py`); returns (parent's
        partial page, child's page) for the caller to copy, or None when the computed
        tokens end on a block boundary. Full pages are never written again, so sharing
        them is safe; the partial one is written by each fork's next token, so it is not."""
        if child.block_table:
            raise ValueError(f"sequence {child.seq_id} already holds KV blocks")
        full, rest = divmod(parent.num_computed_tokens, self.block_size)
        for block in parent.block_table[:full]:
            self._refs[block] += 1
            child.block_table.append(block)
        child.block_hashes = list(parent.block_hashes[:full])
        if not rest:
            return None
        if not self.num_free_blocks:
            raise OutOfBlocksError(f"no free KV block to fork sequence {parent.seq_id}")
        page = self._take()
        child.block_table.append(page)
        return parent.block_table[full], page

    # -- prefix cache ----------------------------------------------------------------------

    def match_prefix(self, seq: Sequence, max_blocks: int | None = None) -> tuple[int, int]:
        """(blocks of `seq`'s prompt found in the cache, how many of those are idle), at
        most `max_blocks` (None: no bound but the prompt's).

        At most all but the prompt's last token match, so a step still runs at least one
        prompt token and produces the logits of the first sampled token.
        """
        if self.cache is None:
            return 0, 0
        if seq.prompt_hashes is None:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            seq.prompt_hashes = chain_hashes(prompt, self.block_size, self.root_for(seq))
        limit = (seq.num_prompt_tokens - 1) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        hits = idle = 0
        for key in seq.prompt_hashes[:limit]:
            block = self.cache.lookup(key)
            if block is None:
                break
            hits += 1
            idle += self.cache.is_idle(block)
        return hits, idle

    def admit(self, seq: Sequence, max_blocks: int | None = None) -> int:
        """Take the cached blocks of `seq`'s prompt (at most `max_blocks`) as its first
        pages; returns tokens reused."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds KV blocks")
        hits, _ = self.match_prefix(seq, max_blocks)
        for key in seq.prompt_hashes[:hits] if hits else ():
            block = self.cache.lookup(key)
            if self._refs[block] == 0:
                self.cache.acquire(block)
            self._refs[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(key)
        seq.num_computed_tokens = seq.num_cached_tokens = hits * self.block_size
        return seq.num_cached_tokens

    def commit(self, seq: Sequence) -> None:
        """Index the blocks of `seq` that became full and computed since the last call."""
        if self.cache is None:
            return
        start, full = len(seq.block_hashes), seq.num_computed_tokens // self.block_size
        if full <= start:
            return
        keys = (seq.prompt_hashes or [])[start:full]
        done = seq.block_hashes + keys
        root = self.root_for(seq)
        keys += chain_hashes(seq.token_ids, self.block_size, root, len(done), full, done)
        for i, key in enumerate(keys, start):
            seq.block_hashes.append(key)
            block = seq.block_table[i]
            # Another page may hold this prefix already (two equal prompts prefilled at
            # once); this one then stays unindexed and is freed, not kept, at the end.
            if self._keys[block] is None and self.cache.insert(key, block):
                self._keys[block] = key

    def root_for(self, seq: Sequence) -> bytes:
        """Where `seq`'s hash chain starts: the pool's root, salted by its request's salt
        (also the key of its empty prefix, under which short state snapshots are kept)."""
        return salted_root(self.cache.root, seq.cache_salt)

    # -- checks ----------------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless every page is in exactly one state and each reference
        count equals the number of `seqs` (all live holders) whose table holds the page."""
        problems: list[str] = []
        holders: Counter[int] = Counter()
        for seq in seqs:
            table = seq.block_table
            if len(set(table)) != len(table):
                problems.append(f"sequence {seq.seq_id} holds a page twice: {table}")
            if seq.num_computed_tokens > len(table) * self.block_size:
                problems.append(f"sequence {seq.seq_id} computed past its pages")
            holders.update(table)
        for block in range(self.num_blocks):
            if self._refs[block] != holders[block]:
                problems.append(
                    f"page {block}: ref count {self._refs[block]}, {holders[block]} holders"
                )
        free = list(self._free)
        if len(set(free)) != len(free):
            problems.append(f"a page is on the free list twice: {sorted(free)}")
        idle = dict(self.cache.idle_items()) if self.cache else {}
        for block in free:
            if self._refs[block] or self._keys[block] is not None or block in idle:
                problems.append(f"free page {block} is held, indexed or idle")
        for block, key in idle.items():
            if self._refs[block] or self._keys[block] != key:
                problems.append(f"idle page {block} is held or indexed under another key")
        for key, block in self.cache.items() if self.cache else ():
            if self._keys[block] != key:
                problems.append(f"the cache indexes page {block} under a key it does not carry")
        for block, key in enumerate(self._keys):
            if key is not None and (self.cache is None or self.cache.lookup(key) != block):
                problems.append(f"page {block} carries a key the cache does not index")
        held = sum(1 for r in self._refs if r > 0)
        if held + len(free) + len(idle) != self.num_blocks:
            problems.append(
                f"{held} held + {len(free)} free + {len(idle)} idle != {self.num_blocks} pages"
            )
        if problems:
            raise AssertionError("; ".join(problems[:8]))
