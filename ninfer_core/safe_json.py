"""JSON from untrusted model files, parsed within a size and a nesting-depth limit.

`json.loads` recurses once per nesting level: a 100k-deep document raises `RecursionError`
(not a `ValueError`, so callers' handlers miss it) and, in a thread with a small stack, can
crash outright. Real `config.json`, `generation_config.json` and `tokenizer_config.json`
files nest a handful of levels and weigh kilobytes to a few megabytes, so both limits are
checked before the parser runs, and a violation is a `ValueError` like any other bad JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: Characters a model's JSON file may have (a tokenizer_config.json with a large
#: `added_tokens_decoder` reaches a few MiB; config.json files are a few KiB).
MAX_JSON_CHARS = 64 << 20
#: Nesting levels (real files use at most 4 or 5).
MAX_JSON_DEPTH = 64

# A JSON string (escapes included), and everything that is not a bracket.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class JSONLimitError(ValueError):
    """The document is larger or nested deeper than a model file may be."""


def nesting_depth(text: str) -> int:
    """The deepest `[`/`{` nesting of `text`, brackets inside strings not counted.

    Linear, and never recursive: it is what makes a 100k-deep document harmless.
    """
    depth = deepest = 0
    for char in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        depth += 1 if char in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def loads_limited(
    text: str, *, max_chars: int = MAX_JSON_CHARS, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """`json.loads(text)` after checking its size and nesting; raises ValueError
    (`JSONLimitError` for a limit, `json.JSONDecodeError` for bad JSON)."""
    if len(text) > max_chars:
        raise JSONLimitError(f"it has {len(text):,} characters; the limit is {max_chars:,}")
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JSONLimitError(f"it nests {depth:,} levels deep; the limit is {max_depth}")
    return json.loads(text)
