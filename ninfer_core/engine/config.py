"""`EngineConfig`: how many requests run and wait, how a step is filled, how big the KV pool is.

Each field carries its CLI help (`opt`), so `ninfer-serve` generates its options from this class.
`block_size` and `max_context` repeat `RuntimeConfig`'s fields of the same name: the engine
owns the KV pool, so a command that builds an engine takes them from here and skips them there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_core.config import opt


@dataclass
class EngineConfig:
    """Continuous batching, the bounded queue, the paged KV pool and the prefix cache."""

    max_concurrency: int = opt(2, "sequences that run (prefill or decode) at the same time")
    max_pending_requests: int = opt(16, "requests that may wait for a free slot; more: 429")
    max_pending_per_key: int = opt(
        0, "requests one API key may have waiting; more: 429 (0: only max-pending-requests)"
    )
    pending_timeout_ms: int = opt(
        0, "longest wait in the queue; 0: derived from the work queued ahead (docs/engine.md)"
    )
    prefill_chunk: int = opt(1024, "token budget of one step: decode tokens first, then prefill")
    decode_share: float = opt(
        0.5,
        "while streams decode, prefill beside them gets at most 1 - this of the time, so a "
        "stream keeps about this fraction of its rate alone (engine/pacing.py); 0: no pacing",
    )
    max_context: int = opt(4096, "longest sequence (prompt + output) in tokens")
    kv_capacity: int = opt(0, "KV pool size in tokens, shared by all sequences; 0: max-context")
    block_size: int = opt(16, "tokens per KV cache block (page)")
    prefix_cache: bool = opt(True, "reuse the KV of full blocks shared with earlier requests")
    state_snapshots: int = opt(
        -1,
        "a model with state layers (hybrid): snapshots of its states the prefix cache keeps "
        "(docs/engine.md); -1: 2 x max-concurrency, 0: no prefix cache for such a model",
    )
    state_snapshot_interval: int = opt(
        1024, "a hybrid model: snapshot a long prompt's states every this many tokens; 0: never"
    )

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "prefill_chunk", "max_context", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "max_pending_requests", "max_pending_per_key", "pending_timeout_ms", "kv_capacity",
            "state_snapshot_interval",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), got {self.decode_share}")
        if self.state_snapshots < -1:
            raise ValueError(f"state_snapshots must be >= -1, got {self.state_snapshots}")

    @property
    def snapshot_count(self) -> int:
        """State snapshots a model with state layers keeps (0 with the prefix cache off)."""
        if not self.prefix_cache:
            return 0
        return 2 * self.max_concurrency if self.state_snapshots < 0 else self.state_snapshots

    def context_for(self, model_max_positions: int) -> int:
        """The context the engine really serves: `max_context`, but never past the positions
        the model was trained for. The plan and the engine both read it here, so the plan
        printed at startup sizes the same context the engine then enforces."""
        return min(self.max_context, model_max_positions)
