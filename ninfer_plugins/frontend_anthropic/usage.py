"""Anthropic's `usage`: the prompt split into cache reads, cache writes and the rest.

Anthropic counts a prompt in three parts that add up to it: `cache_read_input_tokens`
(served from the cache), `cache_creation_input_tokens` (written to the cache by this
request) and `input_tokens` (neither). NInfer's prefix cache is automatic: a request reads
the full KV blocks an earlier prompt left (`engine/prefix_cache.py`), and those are its
cache reads, always. In Anthropic's API only a request with a `cache_control` breakpoint
writes to the cache; so here too, a request with none counts every token it did not read
as `input_tokens` (clients that bill or budget by usage read it), and one with a
breakpoint counts the full blocks it wrote as cache writes (the whole prompt's, not only
up to the breakpoint: the pool keeps them all); the tail that does not fill a block is
input either way.
A request that sets `return_spec_stats` also gets its speculative rounds, as `spec_stats`.
"""

from __future__ import annotations

from typing import Any

from ninfer_core.engine.config import EngineConfig
from ninfer_core.engine.request import Usage
from ninfer_plugins.frontend_anthropic.wire import PromptFields


def cache_writes(u: Usage, config: EngineConfig) -> int:
    """Prompt tokens this request put into the prefix cache: its full blocks, less the ones
    it read (none with the cache off)."""
    if not config.prefix_cache:
        return 0
    full = u.prompt_tokens // config.block_size * config.block_size
    return max(0, full - u.cached_tokens)


def has_breakpoint(data: PromptFields) -> bool:
    """Whether the request marks a `cache_control` breakpoint: on a tool, a system block
    or a content block of a message (tool results' own blocks included)."""
    blocks: list[Any] = list(data.tools or [])
    if isinstance(data.system, list):
        blocks += data.system
    for message in data.messages:
        if isinstance(message.content, list):
            blocks += message.content
            for block in message.content:
                if isinstance(getattr(block, "content", None), list):
                    blocks += block.content
    return any(getattr(block, "cache_control", None) is not None for block in blocks)


def usage(
    u: Usage, config: EngineConfig, *, breakpoint: bool = False, with_spec: bool = False
) -> dict[str, Any]:
    """Anthropic's usage (`breakpoint`: the request marks a cache breakpoint, so what it
    wrote counts as cache writes); with `with_spec` (the request's `return_spec_stats`)
    and an engine that speculates, also `spec_stats`. Left out otherwise, not null, so an
    answer nobody asked extras of is exactly Anthropic's shape."""
    written = cache_writes(u, config) if breakpoint else 0
    out: dict[str, Any] = {
        "input_tokens": u.prompt_tokens - u.cached_tokens - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }
    if with_spec and u.spec is not None:
        out["spec_stats"] = u.spec.to_json()
    return out
