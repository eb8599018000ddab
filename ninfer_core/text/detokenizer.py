"""Streaming token ids back into text without ever emitting half a character.

Byte-level tokenizers split one character (an emoji, most CJK) over several tokens, and a
decode of a partial byte sequence ends in U+FFFD. Re-decoding the whole output on every
token would be correct but quadratic; instead each step decodes a short window: the tokens
not yet emitted, after the ones emitted by the step before as context (so decoders that
strip a leading space at the start of a string treat the new text as a continuation), and
emits only the text past what the context alone decodes to.
"""

from __future__ import annotations

from collections.abc import Sequence

from ninfer_core.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
#: How many of `context_ids` (the prompt's tail) the first decodes see as context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed ids one at a time; get text deltas whose concatenation is the decoded text.

    After `finish()`, the deltas joined equal `tokenizer.decode(ids, skip_special_tokens)`
    (with `context_ids`, the text those ids add after the context).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # context_ids (the prompt's tail) only shape how the first tokens decode
        self._ids: list[int] = list(context_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # window start: context for the decode
        self._read = len(self._ids)  # ids before this were emitted already
        self._num_context = len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        """The ids fed so far (context excluded)."""
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        # hold back while the window ends in a partial character (decoded as U+FFFD)
        if len(text) <= len(prefix_text) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        # the text just emitted becomes the next window's context; its start is a
        # character boundary, so both decodes of the next window agree on that part
        self._prefix = self._read
        self._read = len(self._ids)
        return text[len(prefix_text) :]

    def feed(self, token_id: int) -> str:
        """Add one id; return the new, complete text (often "" while a character is split)."""
        self._ids.append(token_id)
        return self._delta(final=False)

    def feed_many(self, token_ids: Sequence[int]) -> str:
        """Add several ids (a speculative round); same text as feeding them one by one."""
        return "".join(self.feed(t) for t in token_ids)

    def finish(self) -> str:
        """The text still held back; a sequence that ends mid-character ends in U+FFFD."""
        return self._delta(final=True)
