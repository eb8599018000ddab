"""The engine: sequences, KV page allocation, per-step attention metadata, the model runner."""

from ninfer_core.engine.attention_meta import AttentionMetadata
from ninfer_core.engine.block_manager import BlockManager, OutOfBlocksError
from ninfer_core.engine.model_runner import ModelRunner
from ninfer_core.engine.sequence import Sequence

__all__ = ["AttentionMetadata", "BlockManager", "ModelRunner", "OutOfBlocksError", "Sequence"]
