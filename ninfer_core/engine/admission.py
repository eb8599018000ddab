"""The checks a request passes before it is queued: every way it could never be served is
refused at once, with the reason, rather than discovered mid-decode after it held pages.

Each check takes what it measures against explicitly (the vocabulary, the context, the KV
pool), so the engine's `add` reads as: check, build the sequence, queue it.
"""

from __future__ import annotations

from ninfer_core.engine.block_manager import BlockManager
from ninfer_core.engine.fanout import can_fork, family_blocks
from ninfer_core.engine.request import (
    GenerationRequest,
    InvalidRequestError,
    RequestTooLargeError,
)
from ninfer_core.plugin_types import KVStore


def admitted_max_tokens(
    request: GenerationRequest,
    *,
    vocab_size: int,
    max_context: int,
    block_manager: BlockManager,
) -> int:
    """The completion tokens `request` may produce (its own `max_tokens`, else what the
    context leaves; 0 for an embedding); raises when its prompt holds a token outside the
    vocabulary or it cannot fit the context or the whole KV pool."""
    n = len(request.prompt_ids)
    vocab = vocab_size
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
        bad = next(t for t in request.prompt_ids if not 0 <= t < vocab)
        raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    max_tokens = request.max_tokens or max(0, max_context - n)
    if request.pooling is not None:  # an embedding: the prompt alone (pooling.py)
        max_tokens = 0
        if n > max_context:
            raise RequestTooLargeError(f"the input has {n} tokens; the context holds {max_context}")
    elif not max_tokens or n + max_tokens > max_context:
        raise RequestTooLargeError(
            f"the prompt has {n} tokens and max_tokens is {max_tokens}: "
            f"{n + max_tokens} tokens; the context holds {max_context}"
        )
    if block_manager.blocks_for(n + max_tokens) > block_manager.num_blocks:
        raise RequestTooLargeError(
            f"prompt plus max_tokens is {n + max_tokens} tokens; the KV pool holds "
            f"{block_manager.num_blocks * block_manager.block_size}"
        )
    return max_tokens


def check_fan_out(
    request: GenerationRequest,
    max_tokens: int,
    *,
    max_concurrency: int,
    speculative: bool,
    kv_store: KVStore,
    kv_codec: str,
    block_manager: BlockManager,
) -> None:
    """Refuse an `n` this engine cannot serve (`engine/fanout.py` says why)."""
    n = request.n
    if n == 1:
        return
    if n > max_concurrency:
        raise InvalidRequestError(
            f"n={n} is more than this server runs at once (max concurrency {max_concurrency})"
        )
    why = None
    if speculative:
        why = "this server decodes speculatively"
    elif not can_fork(kv_store):
        why = f"the {kv_codec} KV store cannot copy a page"
    if why is not None:
        raise InvalidRequestError(f"n > 1 is not supported here: {why}")
    bm, prompt = block_manager, len(request.prompt_ids)
    if family_blocks(bm, prompt, max_tokens, n) > bm.num_blocks:
        raise RequestTooLargeError(
            f"the prompt's {prompt} tokens once plus n={n} times max_tokens={max_tokens} "
            f"need {family_blocks(bm, prompt, max_tokens, n)} KV blocks; the pool holds "
            f"{bm.num_blocks}"
        )
