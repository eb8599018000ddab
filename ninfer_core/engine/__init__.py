"""The engine: sequences, KV blocks and the prefix cache, the scheduler, the step loop, and
the runtime that wires a model to its KV pool.

Importing this package costs little: the engine and its dependencies load on first
use of the names below.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "BlockManager": "ninfer_core.engine.block_manager",
    "OutOfBlocksError": "ninfer_core.engine.block_manager",
    "ModelRunner": "ninfer_core.engine.model_runner",
    "Runtime": "ninfer_core.engine.runtime",
    "RuntimeSpec": "ninfer_core.engine.runtime",
    "build_runtime": "ninfer_core.engine.runtime",
    "assemble_runtime": "ninfer_core.engine.runtime",
    "Sequence": "ninfer_core.engine.sequence",
    "Engine": "ninfer_core.engine.engine",
    "EngineConfig": "ninfer_core.engine.config",
    "GenerationRequest": "ninfer_core.engine.request",
    "TokenEvent": "ninfer_core.engine.request",
    "FinishEvent": "ninfer_core.engine.request",
    "Usage": "ninfer_core.engine.request",
    "EngineError": "ninfer_core.engine.request",
    "OverloadedError": "ninfer_core.engine.request",
    "QueueTimeoutError": "ninfer_core.engine.request",
    "RequestTooLargeError": "ninfer_core.engine.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ninfer_core.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
