"""`StateSnapshots`: the prefix cache of a model with state layers (Gated DeltaNet, ...).

A cached page holds the K/V of its tokens for the attention layers, but a state layer keeps
one fixed-size state per sequence, updated token by token: resuming after P cached tokens
needs that state *as it was after exactly P tokens*. So the engine keeps snapshots. A
snapshot at position P of a prompt is

- the current state of every state layer after P tokens (one buffer of the sequence's slot,
  `SequenceStatePool.save`);
- the chain key of its `P // block_size` full blocks (`prefix_cache.chain_hashes`; the
  request's salted root when there are none), so the K/V of those blocks come from the
  ordinary prefix cache, shared with every other sequence;
- the token ids of the partial tail `[P // block_size * block_size, P)` and, when there is
  one, the raw bytes of that partly filled page of every paged layer (`KVStore.save_pages`:
  codes and scales for a quantized store, so a restore is bit-exact).

A new prompt resumes at the longest P <= its length - 1 for which a snapshot exists whose
full blocks are all in the prefix cache and whose tail tokens are the prompt's: it takes
those blocks, loads the tail into a fresh page, restores the states into its slot, and runs
only the tokens after P. Taking P anywhere, not only on the block grid, is what lets a
prompt shorter than one block hit its own earlier run; vLLM instead keeps states per block
and raises the block size to hundreds of tokens, so short prompts never hit.

Snapshots are taken where they are likely to be reused (`capture_points`):

- the end of each prompt's all-but-last token (P = prompt - 1): the scheduler ends the
  prompt's last prefill chunk there, and the last token runs in the next step with the
  decodes. The same prompt sent again resumes right there;
- every `interval` tokens of a prompt (whole blocks; the scheduler ends a chunk at a boundary
  it would cross): prompts that share a long prefix and then differ;
- the end of the full blocks a prompt found in the prefix cache, when no snapshot reaches
  that far: the K/V there are shared with an earlier prompt (a common system prompt), so
  the next prompt that shares them is likely to resume there too;
- the end of a request (the state after every token it consumed): a multi-turn follow-up,
  whose prompt is the earlier prompt, its answer and more.

At most `capacity` snapshots are kept, least recently used evicted first; their bytes are
fixed (`bytes_each`), so the memory plan counts them (`ninfer plan`'s `state snapshots`). A
store without `save_pages`/`load_pages` gets block-aligned snapshots only. Plain block hits
without a snapshot are never used for such a model: the state would be missing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.sequence import Sequence
from ninfer_core.kv.state import SequenceStatePool
from ninfer_core.plugin_types import KVStore

#: A snapshot's identity: the chain key of its full blocks and its tail's token ids.
SnapshotKey = tuple[bytes, tuple[int, ...]]


@dataclass(frozen=True)
class Snapshot:
    """The state after the first `position` tokens of some prompt, and its partial page."""

    position: int
    #: Chain key of its `position // block_size` full blocks (the salted root if none).
    chain_key: bytes
    #: Token ids past the last full block.
    tail: tuple[int, ...]
    #: `SequenceStatePool.save`: layer -> its state tensors.
    states: dict[int, tuple[torch.Tensor, ...]]
    #: `KVStore.save_pages` of the partial page; None when `position` is block-aligned.
    pages: tuple[torch.Tensor, ...] | None

    @property
    def nbytes(self) -> int:
        tensors = [t for ts in self.states.values() for t in ts] + list(self.pages or ())
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class SnapshotHit:
    """Where a prompt can resume: the snapshot, after how many full cached blocks, and how
    many of those are idle (admission counts them as taken)."""

    snapshot: Snapshot
    blocks: int
    idle: int


class StateSnapshots:
    """Up to `capacity` snapshots, LRU; `interval`: tokens between two snapshots of a long
    prompt (rounded down to whole blocks; 0: prompt and request ends only)."""

    def __init__(
        self,
        capacity: int,
        interval: int,
        block_manager: BlockManager,
        states: SequenceStatePool,
        kv_store: KVStore,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"state snapshots need a positive capacity, got {capacity}")
        if block_manager.cache is None:
            raise ValueError("state snapshots need the block manager's prefix cache")
        bs = block_manager.block_size
        self.capacity, self.block_size = capacity, bs
        self.interval = max(1, interval // bs) * bs if interval > 0 else 0
        self.block_manager, self.states, self.kv_store = block_manager, states, kv_store
        #: Snapshots may end inside a page (the store can copy pages raw).
        self.partial = kv_store.save_pages is not None and kv_store.load_pages is not None
        self._lru: OrderedDict[SnapshotKey, Snapshot] = OrderedDict()
        #: chain key -> the tails kept under it, for the lookup.
        self._tails: dict[bytes, set[tuple[int, ...]]] = {}
        #: seq_id -> the end of the cached full blocks it was admitted with, where no
        #: snapshot reached: a capture point for that sequence's prefill.
        self._shared: dict[int, int] = {}
        self.captured = self.evicted = self.hits = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        """Bytes the kept snapshots hold now."""
        return sum(s.nbytes for s in self._lru.values())

    # -- where to take them ----------------------------------------------------------------

    def usable(self, position: int) -> bool:
        """A snapshot can be taken at `position` (a partial page only if the store copies)."""
        return position > 0 and (self.partial or position % self.block_size == 0)

    def chunk(self, seq: Sequence, n: int) -> int:
        """`n` prefill tokens of `seq`, cut so the chunk ends at the first capture point
        it would cross: the prompt's all-but-last token, an interval boundary, or the end
        of the cached blocks it was admitted with."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        last = seq.num_prompt_tokens - 1
        if start < last < end and self.usable(last):
            end = last
        if self.interval:
            boundary = (start // self.interval + 1) * self.interval
            end = min(end, boundary) if boundary < last else end
        shared = self._shared.get(seq.seq_id, 0)
        if start < shared < end:
            end = shared
        return end - start

    def at_capture_point(self, seq: Sequence) -> bool:
        """`seq`'s prefill just stopped where a snapshot is wanted (see `chunk`)."""
        p = seq.num_computed_tokens
        if not seq.is_prefilling or p <= seq.num_cached_tokens or not self.usable(p):
            return False
        if p == self._shared.get(seq.seq_id):
            return True
        return p == seq.num_prompt_tokens - 1 or bool(self.interval and p % self.interval == 0)

    def forget(self, seq: Sequence) -> None:
        """`seq` ended: drop what was remembered of it."""
        self._shared.pop(seq.seq_id, None)

    # -- taking and finding them -----------------------------------------------------------

    def capture(self, seq: Sequence, position: int) -> bool:
        """Snapshot `seq`'s slot, whose current state is that after `position` tokens;
        False when nothing new was kept (not usable, blocks not indexed, already kept)."""
        if seq.state_slot is None or not self.usable(position):
            return False
        if position > seq.num_computed_tokens:
            return False  # the K/V of the tail are not all written
        full, rest = divmod(position, self.block_size)
        if len(seq.block_hashes) < full:
            return False  # its full blocks are not in the prefix cache (yet)
        chain = seq.block_hashes[full - 1] if full else self.block_manager.root_for(seq)
        tail = tuple(seq.token_ids[full * self.block_size : position])
        key = (chain, tail)
        if key in self._lru:
            self._lru.move_to_end(key)
            return False
        pages = None
        if rest:
            block = torch.tensor([seq.block_table[full]], device=self.kv_store.device)
            pages = self.kv_store.save_pages(block)
        states = self.states.save(seq.state_slot)
        self._lru[key] = Snapshot(position, chain, tail, states, pages)
        self._tails.setdefault(chain, set()).add(tail)
        self.captured += 1
        while len(self._lru) > self.capacity:
            (old_chain, old_tail), _ = self._lru.popitem(last=False)
            tails = self._tails[old_chain]
            tails.discard(old_tail)
            if not tails:
                del self._tails[old_chain]
            self.evicted += 1
        return True

    def match(self, seq: Sequence) -> SnapshotHit | None:
        """The longest prefix of `seq`'s prompt (all but its last token at most) that has
        both its full blocks in the prefix cache and a snapshot; None if none has."""
        bm, bs = self.block_manager, self.block_size
        hits, _ = bm.match_prefix(seq)
        keys, n = seq.prompt_hashes or [], seq.num_prompt_tokens
        prompt = seq.token_ids
        # Every snapshot after k full blocks ends before block k + 1's end, so the first k
        # (from the longest) with one holds the longest.
        for k in range(hits, -1, -1):
            chain = keys[k - 1] if k else bm.root_for(seq)
            best: tuple[int, ...] | None = None
            for tail in self._tails.get(chain, ()):
                end = k * bs + len(tail)
                if end > n - 1 or (best is not None and len(tail) <= len(best)):
                    continue
                if tuple(prompt[k * bs : end]) == tail:
                    best = tail
            if best is not None:
                _, idle = bm.match_prefix(seq, max_blocks=k)
                return SnapshotHit(self._lru[(chain, best)], k, idle)
        return None

    def admit(self, seq: Sequence) -> int:
        """Resume `seq` (holding a fresh state slot, no pages) from its best snapshot: its
        full blocks shared, the tail page loaded into a new page, the states restored.
        Returns the prompt tokens reused (0: none, it starts from the zero state)."""
        hit = self.match(seq)
        hits, _ = self.block_manager.match_prefix(seq)
        if hits * self.block_size > (hit.snapshot.position if hit else 0):
            self._shared[seq.seq_id] = hits * self.block_size
        if hit is None:
            return 0
        snap = hit.snapshot
        self.block_manager.admit(seq, max_blocks=hit.blocks)
        if snap.pages is not None:
            self.block_manager.allocate(seq, snap.position - seq.num_computed_tokens)
            block = torch.tensor([seq.block_table[hit.blocks]], device=self.kv_store.device)
            self.kv_store.load_pages(block, snap.pages)
        self.states.restore(seq.state_slot, snap.states)
        seq.num_computed_tokens = seq.num_cached_tokens = seq.state_position = snap.position
        self._lru.move_to_end((snap.chain_key, snap.tail))
        self.hits += 1
        return snap.position

    def check_invariants(self) -> None:
        """Raise AssertionError unless the lookup index lists exactly the kept snapshots,
        each under its own key, and no more are kept than the budget."""
        problems = []
        listed = {(chain, tail) for chain, tails in self._tails.items() for tail in tails}
        if listed != set(self._lru):
            problems.append(f"{len(listed)} snapshots indexed, {len(self._lru)} kept")
        if len(self._lru) > self.capacity:
            problems.append(f"{len(self._lru)} snapshots kept, the budget is {self.capacity}")
        for (chain, tail), snap in self._lru.items():
            keyed = (snap.chain_key, snap.tail) == (chain, tail)
            if not keyed or snap.position % self.block_size != len(tail):
                problems.append(f"the snapshot at {snap.position} is kept under another key")
            if (snap.pages is None) != (len(tail) == 0):
                problems.append(f"the snapshot at {snap.position} has a wrong tail page")
        if problems:
            raise AssertionError("; ".join(problems[:8]))
