"""The prefix cache's index: full KV blocks by the hash chain of the tokens that filled them.

Block i's key hashes block i-1's key with block i's token ids, so equal keys mean equal
*prefixes*, not merely equal blocks: attention made each block's K/V from everything before
it. The chain starts from a salt naming whatever else changes a block's bytes (the KV codec),
so two pools that encode K/V differently never share a key. A request may carry a cache salt
(`salted_root`): its chain then starts from a root of its own, so requests with different salts
never share a block, whatever their tokens, and `cached_tokens` tells one client nothing about
another's prompts. Keys are 128-bit BLAKE2b digests:
a collision would silently serve another prompt's KV, and at 2**-64 odds for billions of
blocks that is not a risk worth checking token by token.

Unreferenced cached blocks stay here, in least-recently-freed order, until the allocator
needs a page and evicts the oldest.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

_DIGEST = 16


def root_hash(salt: str) -> bytes:
    """The chain's starting key for a pool whose block contents depend on `salt`."""
    return blake2b(salt.encode(), digest_size=_DIGEST, person=b"ninfer-kv").digest()


def salted_root(root: bytes, cache_salt: str | None) -> bytes:
    """The chain's root for requests with `cache_salt` (None: the pool's own `root`).

    Mixing the salt into the root is mixing it into the first block's key, and through the
    chain into every later one. The root is a fixed 16 bytes, so `root ‖ salt` is unambiguous;
    the personalisation keeps a salted root apart from any block key.
    """
    if cache_salt is None:
        return root
    data = root + cache_salt.encode("utf-8", "surrogatepass")
    return blake2b(data, digest_size=_DIGEST, person=b"ninfer-salt").digest()


def block_hash(previous: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of a full block holding `token_ids` after the prefix keyed `previous`."""
    h = blake2b(previous, digest_size=_DIGEST)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: bytes,
    start: int = 0,
    stop: int | None = None,
    known: Sequence[bytes] = (),
) -> list[bytes]:
    """Keys of the full blocks `start:stop` of `token_ids` (all from `start` when `stop` is
    None), chained after `known`, the keys of blocks `:start`."""
    out: list[bytes] = []
    previous = known[-1] if known else root
    full = len(token_ids) // block_size
    for i in range(start, full if stop is None else min(stop, full)):
        previous = block_hash(previous, token_ids[i * block_size : (i + 1) * block_size])
        out.append(previous)
    return out


class PrefixCache:
    """key -> block id for blocks whose K/V are complete, plus the LRU of unreferenced ones."""

    def __init__(self, salt: str) -> None:
        self.root = root_hash(salt)
        self._by_key: dict[bytes, int] = {}
        #: Cached blocks no sequence holds: block id -> key, oldest first.
        self._idle: OrderedDict[int, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def num_idle(self) -> int:
        """Blocks that can be evicted (cached, held by no sequence)."""
        return len(self._idle)

    def lookup(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def is_idle(self, block_id: int) -> bool:
        return block_id in self._idle

    def insert(self, key: bytes, block_id: int) -> bool:
        """Index `block_id` under `key`; False when another block already holds that prefix."""
        if key in self._by_key:
            return False
        self._by_key[key] = block_id
        return True

    def release(self, block_id: int, key: bytes) -> None:
        """Its last holder let go: keep it, newest in the eviction order."""
        self._idle[block_id] = key

    def acquire(self, block_id: int) -> None:
        """A sequence took an idle block back (a prefix hit): it may no longer be evicted."""
        del self._idle[block_id]

    def evict(self) -> int:
        """Drop the least recently released block from the index and return its id."""
        block_id, key = self._idle.popitem(last=False)
        del self._by_key[key]
        return block_id

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._by_key.items())

    def idle_items(self) -> list[tuple[int, bytes]]:
        return list(self._idle.items())
