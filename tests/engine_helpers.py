"""Helpers for the engine tests on conftest's `engine_model` (a tiny 2-layer fp32 Qwen3)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.engine import Engine
from ninfer_core.engine.sequence import Sequence


def prompt(n: int, seed: int) -> list[int]:
    """`n` token ids in [3, 400), the same for the same seed."""
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def computed(bm: BlockManager, ids: list[int], salt: str | None = None) -> Sequence:
    """A sequence admitted, allocated and 'run' through all its tokens, blocks committed."""
    seq = Sequence(ids, cache_salt=salt)
    bm.admit(seq)
    bm.allocate(seq, seq.num_pending_tokens)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    return seq


def tiny_engine(
    engine_model: tuple, *, clock: Callable[[], float] = time.monotonic, **config
) -> Engine:
    """An fp32-KV `Engine` on `engine_model` (loaded, host, device); `config` goes to
    `EngineConfig`, with a KV capacity of 1024 tokens unless it says otherwise."""
    loaded, host, device = engine_model
    return Engine(loaded, EngineConfig(**{"kv_capacity": 1024, **config}), host=host,
                  device=device, kv_dtype="fp32", clock=clock)  # fmt: skip
