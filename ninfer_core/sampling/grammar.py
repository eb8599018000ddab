"""Constrained decoding: a request's grammar as a per-token mask over the vocabulary.

A `Constraint` says what the answer must be (a JSON schema, any JSON object, a Lark or a
GBNF grammar); `GrammarCompiler` turns it into a `GrammarMatcher` for one request, and the
matcher gives, before each token, the set of tokens that keep the answer inside the grammar.
The engine masks the rest to -inf before the sampler (`engine/constraints.py`).

Why llguidance (`bench/grammar_mask.py`, docs/serving.md "Constrained decoding"): of the
three libraries made for this, it compiles a nested schema in ~4-5 ms on either vocabulary
(outlines-core: 714 ms for SmolLM2's 49,152 tokens, since it builds a whole-vocabulary index
per schema), covers every schema feature the bench tries (outlines-core silently drops
`exclusiveMinimum` and `allOf`), reads Lark and GBNF grammars (outlines-core only regexes),
bounds its own work (`LLParserLimits`: a schema is untrusted input) and has no dependencies.
xgrammar computes a mask faster (~3 µs against 11-65 µs mean per token), but would bring
transformers, triton, tvm-ffi and pydantic into every install; the whole masking path costs
~0.2-0.4 ms a token, under 1% of a SmolLM2 decode step on a CPU.

A matcher counts the tokens it consumed, so a speculative round can consume drafts to mask
the rows after them and roll them back (`rollback`) before the accepted ones are consumed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ninfer_core.text.tokenizer import Tokenizer

#: Largest schema or grammar text a request may send (characters).
MAX_GRAMMAR_CHARS = 256 * 1024
#: Tokens of a new grammar run on a copy before it is accepted (`GrammarCompiler`).
PROBE_TOKENS = 3
#: Compiled (validated) grammars kept, by their text.
CACHE_SIZE = 256
#: JSON as the models write it (`json.dumps`' separators), no free whitespace: with free
#: whitespace a small model can fill its budget with newlines inside an object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

Kind = Literal["json_schema", "json_object", "lark", "gbnf", "regex", "choice"]
_NEG_INF = float("-inf")


#: Longest reason a grammar error carries: llguidance's messages can quote the whole grammar
#: and its parser state (hundreds of KB), which neither a client nor the log needs.
MAX_REASON_CHARS = 300


def bounded(reason: str) -> str:
    """`reason`'s first line, cut to `MAX_REASON_CHARS`."""
    line = reason.strip().splitlines()[0] if reason.strip() else "no reason given"
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 1] + "…"


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled (the request's fault: a 400). Its
    message is bounded (`bounded`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(bounded(reason))


@dataclass(frozen=True)
class Constraint:
    """What a request's answer must match. `text`: the JSON schema (as JSON text) for
    `json_schema`, the grammar for `lark` and `gbnf`, the pattern for `regex`, a JSON list
    of strings for `choice` (the answer is one of them), unused for `json_object`."""

    kind: Kind
    text: str = ""

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema, sort_keys=False, ensure_ascii=False))

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) this constraint compiles to."""
        import llguidance

        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar has more than {MAX_GRAMMAR_CHARS} characters")
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, overrides=JSON_OPTIONS
            )
        if self.kind == "json_schema":
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.text, defaults=JSON_OPTIONS
                )
            except ValueError as exc:
                raise GrammarError(str(exc)) from None
        if self.kind in ("gbnf", "regex", "choice"):
            return llguidance.grammar_from(self.kind, self.text)
        return llguidance.LLMatcher.grammar_from_lark(self.text)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, words_of: int, vocab: int) -> None:
        self._m, self.vocab = matcher, vocab
        self._words = (words_of + 31) // 32

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens that keep the answer inside the grammar now.

        llguidance writes one bit per token (token 32w + i is bit i of word w); numpy's
        `unpackbits` spreads them in ~15 µs for 49k tokens, where shifting in torch took
        ~250 µs, more than computing the mask."""
        bits = np.empty(self._words, dtype="<u4")
        self._m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        flags = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab]
        return flags.astype(np.bool_)

    def consume(self, token: int) -> bool:
        """Advance by `token`; False (and the matcher in error) when the grammar refuses it."""
        return bool(self._m.consume_token(token))

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens")

    @property
    def accepting(self) -> bool:
        """Whether the answer may end here (the grammar is satisfied)."""
        return bool(self._m.is_accepting())

    @property
    def stopped(self) -> bool:
        """Whether nothing may follow: the answer is complete."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return self._m.get_error()


class GrammarCompiler:
    """Compiles constraints for one tokenizer; compiled grammars (a matcher at their start,
    which requests copy) are cached by their text (bounded, least recently used out), so a
    schema sent again costs a dictionary look-up.

    The llguidance tokenizer (a trie of the vocabulary's bytes, ~0.4 s for 49k tokens) is
    built on the first constraint, so an engine that never sees one never pays for it."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab = max(vocab, tokenizer.vocab_size)
        self.logits_vocab = vocab
        self.eos_ids = sorted(eos_ids)
        self._lltok: Any = None
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _limits() -> Any:
        """llguidance's bounds on a grammar's work (a schema is untrusted input): building
        the lexer ~20 ms of fuel, each mask ~14 ms at most, a grammar of 500k symbols;
        past them the grammar is refused (compiling) or the request ends (decoding)."""
        import llguidance

        return llguidance.LLParserLimits(max_grammar_size=500_000)

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.vocab,
                    eos_token=self.eos_ids or None,
                )
            return self._lltok

    def compile(self, constraint: Constraint) -> None:
        """Compile `constraint` (or find it compiled); `GrammarError` with the reason when
        it cannot be (a malformed schema keyword, a grammar that does not parse, one past
        the size limits)."""
        self._template(constraint)

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher at the start of `constraint`'s grammar: a copy of the cached one
        (~1.5 µs, where building it again takes ~0.6 ms on the engine's step thread)."""
        return GrammarMatcher(self._template(constraint).deep_copy(), self.vocab, self.logits_vocab)

    def _template(self, constraint: Constraint) -> Any:
        """The cached matcher of `constraint`, never advanced itself: matchers are copies."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        import llguidance

        try:
            grammar = constraint.grammar()
        except GrammarError:
            raise
        except Exception as exc:  # the converters raise plain exceptions on bad input
            raise GrammarError(str(exc)) from None
        error = llguidance.LLMatcher.validate_grammar(
            grammar, self._ll_tokenizer(), limits=self._limits()
        )
        if error and not error.startswith("WARNING"):
            raise GrammarError(error)
        template = llguidance.LLMatcher(
            self._ll_tokenizer(), grammar, log_level=0, limits=self._limits()
        )
        if template.is_error():
            raise GrammarError(template.get_error())
        self._first_mask(template)
        with self._lock:
            self._cache[constraint] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def _first_mask(self, template: Any) -> None:
        """Run the grammar's first `PROBE_TOKENS` tokens on a copy, so that a grammar that
        compiles but cannot get going is refused now, with a 400, rather than ending its
        request mid-answer: one whose language is empty (the class `[^\\s\\S]`), or one
        past llguidance's limits from its first tokens on (a regex repeating a repeat a
        thousand times, `"a"{1000000}` in GBNF, thousands of alternatives). Each step takes
        an allowed token other than the end of the answer; the work is done once per
        grammar (the template is cached) and bounded by the same limits."""
        probe = GrammarMatcher(template.deep_copy(), self.vocab, self.logits_vocab)
        eos = set(self.eos_ids)
        for step in range(PROBE_TOKENS):
            allowed = probe.allowed()
            if probe.error:
                raise GrammarError(f"the grammar fails on its first tokens: {probe.error}")
            tokens = [int(t) for t in np.flatnonzero(allowed)[:64] if int(t) not in eos]
            if step == 0 and not tokens and not probe.accepting:
                raise GrammarError("the grammar matches nothing: no answer could satisfy it")
            if not tokens or probe.stopped:
                return
            if not probe.consume(tokens[0]):
                raise GrammarError(f"the grammar fails on its first tokens: {probe.error}")


def mask_rows(logits: torch.Tensor, rows: list[tuple[int, np.ndarray]]) -> torch.Tensor:
    """logits [R, V] with row i's disallowed tokens at -inf for each (i, allowed [V] bool);
    a new tensor (the caller's logits are kept for log probabilities).

    On a CPU in numpy, one thread: torch's intra-op threads spin-wait on a busy box, and a
    masked fill of one 49k row then took milliseconds (`masked_fill_` 24 ms, `where` over a
    mask made from numpy 4-15 ms, on a loaded 2-core box) where `numpy.where` takes ~60 µs."""
    if not rows:
        return logits
    keep = np.ones(tuple(logits.shape), dtype=np.bool_)
    for i, allowed in rows:
        keep[i] = allowed
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.where(keep, logits.numpy(), np.float32(_NEG_INF)))
    return torch.where(torch.from_numpy(keep).to(logits.device), logits, _NEG_INF)
