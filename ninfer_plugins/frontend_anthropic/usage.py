"""Anthropic's `usage`: the prompt split into cache reads, cache writes and the rest.

Anthropic counts a prompt in three parts that add up to it: `cache_read_input_tokens`
(served from the cache), `cache_creation_input_tokens` (written to the cache by this
request) and `input_tokens` (neither). NInfer's prefix cache is automatic: a request reads
the full KV blocks an earlier prompt left, and writes every other full block of its prompt
(`engine/prefix_cache.py`); the tail of the prompt that does not fill a block is neither.
A request that sets `return_spec_stats` also gets its speculative rounds, as `spec_stats`.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.request import Usage


def cache_writes(u: Usage, config: EngineConfig) -> int:
    """Prompt tokens this request put into the prefix cache: its full blocks, less the ones
    it read (none with the cache off)."""
    if not config.prefix_cache:
        return 0
    full = u.prompt_tokens // config.block_size * config.block_size
    return max(0, full - u.cached_tokens)


def usage(u: Usage, config: EngineConfig, *, with_spec: bool = False) -> dict[str, Any]:
    """Anthropic's usage; with `with_spec` (the request's `return_spec_stats`) and an engine
    that speculates, also `spec_stats`. Left out otherwise, not null, so an answer nobody
    asked extras of is exactly Anthropic's shape."""
    written = cache_writes(u, config)
    out: dict[str, Any] = {
        "input_tokens": u.prompt_tokens - u.cached_tokens - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }
    if with_spec and u.spec is not None:
        out["spec_stats"] = u.spec.to_json()
    return out
