"""Constrained decoding libraries compared on CPU: mask cost per token and schema coverage.

    python bench/grammar_mask.py [--libs llguidance,xgrammar,outlines-core] [--repeat 3]

For the built-in model's vocabulary (4,096 tokens) and SmolLM2's (49,152), each library
compiles one nested JSON schema (objects in objects, an array of objects, enums, bounded
numbers, required fields), then walks the token ids of a valid instance: at every token it
computes the allowed-token mask and then consumes the token, as a decode step would. It
prints the compile time and the mean and worst mask time per token, then which schema
features each library compiles (a feature it refuses, or compiles into a grammar that
rejects a valid instance, is a miss).

The libraries are optional: the one NInfer uses is a dependency, the others are only for
this comparison (`pip install xgrammar outlines-core`). What it measured, on a 2-core
shared box, and why llguidance was chosen, is in docs/serving.md ("Constrained decoding").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from ninfer_core.builtin_model import BUILTIN_ARTIFACT
from ninfer_core.loading import open_artifact
from ninfer_core.plugin_host import create_host
from ninfer_core.smollm2 import smollm2_path
from ninfer_core.text import Tokenizer
from ninfer_core.text.byte_level import char_to_byte

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "scores": {
            "type": "array",
            "items": {"type": "number", "minimum": 0, "maximum": 1},
            "maxItems": 8,
        },
        "tags": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"key": {"type": "string"}, "on": {"type": "boolean"}},
                "required": ["key", "on"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "role", "address", "scores", "tags"],
    "additionalProperties": False,
}
NESTED_INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "address": {"city": "London", "zip": "12345"},
    "scores": [0.5, 0.75, 1],
    "tags": [{"key": "math", "on": True}, {"key": "poetry", "on": False}],
}

#: (feature, schema, a valid instance): what each library must compile and accept.
FEATURES: list[tuple[str, dict[str, Any], Any]] = [
    ("nested objects, required", NESTED_SCHEMA, NESTED_INSTANCE),
    ("enum", {"enum": ["a", "b", 3]}, 3),
    ("const", {"const": "x"}, "x"),
    ("integer bounds", {"type": "integer", "minimum": -5, "maximum": 120}, 99),
    ("exclusive number bounds", {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5}, 2.5),
    ("string length", {"type": "string", "minLength": 2, "maxLength": 4}, "abc"),
    ("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, "ab-12"),
    ("format date-time", {"type": "string", "format": "date-time"}, "2026-01-02T03:04:05Z"),
    (
        "array min/max items",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [1, 2],
    ),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "s"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True),
    (
        "$ref / $defs",
        {
            "$defs": {"n": {"type": "integer"}},
            "type": "object",
            "properties": {"v": {"$ref": "#/$defs/n"}},
            "required": ["v"],
        },
        {"v": 1},
    ),
    (
        "recursive $ref",
        {
            "$defs": {
                "t": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                    "required": ["kids"],
                }
            },
            "$ref": "#/$defs/t",
        },
        {"kids": [{"kids": []}]},
    ),
    (
        "additionalProperties schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"k": 1},
    ),
    ("nullable type list", {"type": ["string", "null"]}, None),
    (
        "prefixItems (tuple)",
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        [1, "a"],
    ),
    (
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}},
                {"required": ["a"]},
            ]
        },
        {"a": 1},
    ),
]

#: A library: (vocabulary name, tokenizer) -> compile(schema) -> a matcher with
#: mask() (the allowed mask, computed), consume(token) -> bool, accepting() -> bool.
Library = Callable[[Tokenizer, int], Callable[[dict[str, Any]], Any]]


def _llguidance(tokenizer: Tokenizer, eos: int) -> Callable[[dict[str, Any]], Any]:
    import llguidance
    import torch

    tok = llguidance.LLTokenizer(
        tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos
    )
    bitmask = torch.empty((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    class Matcher:
        def __init__(self, schema: dict[str, Any]) -> None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
            self.m = llguidance.LLMatcher(tok, grammar, log_level=0)
            if self.m.is_error():
                raise ValueError(self.m.get_error())

        def mask(self) -> None:
            self.m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

        def consume(self, token: int) -> bool:
            return self.m.consume_token(token)

        def accepting(self) -> bool:
            return self.m.is_accepting()

    return Matcher


def _byte_level_vocab(tokenizer: Tokenizer) -> list[str]:
    """The raw vocabulary entries in id order (byte-level strings, `Ġthe`)."""
    return [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]


def _xgrammar(tokenizer: Tokenizer, eos: int) -> Callable[[dict[str, Any]], Any]:
    import torch
    import xgrammar

    info = xgrammar.TokenizerInfo(
        _byte_level_vocab(tokenizer),
        vocab_type=xgrammar.VocabType.BYTE_LEVEL,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=[eos],
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    bitmask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)

    class Matcher:
        def __init__(self, schema: dict[str, Any]) -> None:
            compiled = compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(",", ":")
            )
            self.m = xgrammar.GrammarMatcher(compiled)

        def mask(self) -> None:
            self.m.fill_next_token_bitmask(bitmask, 0)

        def consume(self, token: int) -> bool:
            return self.m.accept_token(token)

        def accepting(self) -> bool:
            return self.m.is_terminated() or self.m.accept_token(eos)

    del torch
    return Matcher


def _outlines_core(tokenizer: Tokenizer, eos: int) -> Callable[[dict[str, Any]], Any]:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    decoder = char_to_byte()
    tokens: dict[bytes, list[int]] = {}
    specials = tokenizer.all_special_ids
    for i, entry in enumerate(_byte_level_vocab(tokenizer)):
        if i == eos or i in specials or not entry:
            continue
        raw = bytes(decoder[c] for c in entry) if all(c in decoder for c in entry) else None
        if raw is not None:
            tokens.setdefault(raw, []).append(i)
    vocabulary = Vocabulary(eos, tokens)
    mask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    class Matcher:
        def __init__(self, schema: dict[str, Any]) -> None:
            self.g = Guide(Index(build_regex_from_schema(json.dumps(schema)), vocabulary))

        def mask(self) -> None:
            self.g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

        def consume(self, token: int) -> bool:
            try:
                self.g.advance(token)
            except Exception:
                return False
            return True

        def accepting(self) -> bool:
            return self.g.is_finished() or eos in self.g.get_tokens()

    return Matcher


LIBRARIES: dict[str, Library] = {
    "llguidance": _llguidance,
    "xgrammar": _xgrammar,
    "outlines-core": _outlines_core,
}


def walk(matcher_cls: Callable, tokenizer: Tokenizer, repeat: int) -> dict[str, float]:
    """Compile NESTED_SCHEMA, then mask + consume each token of NESTED_INSTANCE."""
    start = time.perf_counter()
    matcher_cls(NESTED_SCHEMA)
    compile_s = time.perf_counter() - start
    ids = tokenizer.encode(json.dumps(NESTED_INSTANCE, separators=(",", ":")), False)
    times: list[float] = []
    for _ in range(repeat):
        matcher = matcher_cls(NESTED_SCHEMA)
        for token in ids:
            start = time.perf_counter()
            matcher.mask()
            times.append(time.perf_counter() - start)
            if not matcher.consume(token):
                raise RuntimeError(f"the grammar refused token {token} of a valid instance")
    return {
        "compile_ms": compile_s * 1e3,
        "tokens": len(ids),
        "mean_us": statistics.fmean(times) * 1e6,
        "p99_us": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6,
        "max_us": max(times) * 1e6,
    }


def coverage(matcher_cls: Callable, tokenizer: Tokenizer) -> list[str]:
    """The FEATURES this library compiles and accepts a valid instance of."""
    ok = []
    for name, schema, instance in FEATURES:
        try:
            matcher = matcher_cls(schema)
            ids = tokenizer.encode(json.dumps(instance, separators=(",", ":")), False)
            if all(matcher.consume(t) for t in ids) and matcher.accepting():
                ok.append(name)
        except Exception:
            continue
    return ok


def engine_path(tokenizer: Tokenizer, eos: int, repeat: int) -> dict[str, float]:
    """NInfer's own per-token cost (`sampling/grammar.py`): the mask as a bool row, the stop
    tokens set, the logits row masked, the token consumed."""
    import torch

    from ninfer_core.sampling.grammar import Constraint, GrammarCompiler, mask_rows

    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, [eos])
    constraint = Constraint.json_schema(NESTED_SCHEMA)
    compiler.compile(constraint)
    ids = tokenizer.encode(json.dumps(NESTED_INSTANCE), False)
    logits = torch.zeros(1, tokenizer.vocab_size)
    times: list[float] = []
    for _ in range(repeat):
        matcher = compiler.matcher(constraint)
        for token in ids:
            start = time.perf_counter()
            allowed = matcher.allowed()
            allowed[eos] = matcher.accepting
            mask_rows(logits, [(0, allowed)])
            times.append(time.perf_counter() - start)
            if not matcher.consume(token):
                raise RuntimeError(f"the grammar refused token {token} of a valid instance")
    return {
        "mean_us": statistics.fmean(times) * 1e6,
        "p99_us": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", default=",".join(LIBRARIES), help="comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="walks of the instance per case")
    args = parser.parse_args()
    host = create_host()
    vocabularies = [("built-in", BUILTIN_ARTIFACT)]
    if (smol := smollm2_path()) is not None:
        vocabularies.append(("smollm2", smol))
    for vocab_name, path in vocabularies:
        tokenizer = Tokenizer.from_artifact(open_artifact(host, path))
        eos = tokenizer.eos_token_id or 0
        print(f"== {vocab_name}: {tokenizer.vocab_size} tokens")
        ours = engine_path(tokenizer, eos, args.repeat)
        print(
            f"{'NInfer path':14s} mask + apply per token mean {ours['mean_us']:7.1f} us"
            f"  p99 {ours['p99_us']:7.1f} us  (llguidance, bool mask, logits row masked)"
        )
        for lib in args.libs.split(","):
            try:
                start = time.perf_counter()
                matcher_cls = LIBRARIES[lib](tokenizer, eos)
                setup_ms = (time.perf_counter() - start) * 1e3
                figures = walk(matcher_cls, tokenizer, args.repeat)
            except Exception as exc:  # a library missing or failing is a row, not a crash
                print(f"{lib:14s} failed: {type(exc).__name__}: {exc}")
                continue
            covered = coverage(matcher_cls, tokenizer)
            print(
                f"{lib:14s} tokenizer {setup_ms:7.1f} ms  compile {figures['compile_ms']:8.1f} ms"
                f"  mask/token mean {figures['mean_us']:7.1f} us  p99 {figures['p99_us']:7.1f} us"
                f"  max {figures['max_us']:8.1f} us  ({figures['tokens']} tokens)"
                f"  features {len(covered)}/{len(FEATURES)}"
            )
            missed = [name for name, _, _ in FEATURES if name not in covered]
            if missed:
                print(f"{'':14s} misses: {', '.join(missed)}")


if __name__ == "__main__":
    main()
