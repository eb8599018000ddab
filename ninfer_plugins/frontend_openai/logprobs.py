"""The engine's `TokenLogprobs` in OpenAI's two shapes: chat's `logprobs.content` entries and
the legacy completions object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token's `bytes` are its own bytes, not those of its decoded text: a byte-level BPE token
that holds half of a character decodes to U+FFFD alone, and `bytes` is how OpenAI lets a
client join such tokens back into the character. Its `token` text is those bytes decoded
with replacement. Byte-level tokens (GPT-2's alphabet, Qwen, Llama 3) and byte-fallback
tokens (`<0x0A>`, SentencePiece models) are mapped exactly; any other token by its text.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Sequence
from functools import cache

from tokenizers import decoders

from ninfer_core.sampling import TokenLogprobs
from ninfer_core.text import Tokenizer
from ninfer_core.text.byte_level import char_to_byte
from ninfer_plugins.frontend_openai import wire

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


#: A byte-level vocabulary entry's characters -> its bytes.
_BYTE_LEVEL = cache(char_to_byte)


class TokenTexts:
    """Each token id's (text, bytes), worked out once per id and kept."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self._special = tokenizer.all_special_ids
        self._known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._known.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = self._known[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None and token_id not in self._special:
            if self._byte_level:
                alphabet = _BYTE_LEVEL()
                if all(c in alphabet for c in piece):
                    return bytes(alphabet[c] for c in piece)
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return self.tokenizer.decode([token_id]).encode()


_TEXTS: weakref.WeakKeyDictionary[Tokenizer, TokenTexts] = weakref.WeakKeyDictionary()


def token_texts(tokenizer: Tokenizer) -> TokenTexts:
    """The server's one `TokenTexts` for `tokenizer` (its cache outlives a request)."""
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        texts = _TEXTS[tokenizer] = TokenTexts(tokenizer)
    return texts


def chat_content(texts: TokenTexts, items: Iterable[TokenLogprobs]) -> list[wire.ChatTokenLogprob]:
    """Chat's `logprobs.content`: per token its text, log probability, bytes and the
    `top_logprobs` alternatives (the sampled token stands apart, as OpenAI sends it)."""
    out = []
    for item in items:
        text, raw = texts(item.token_id)
        top = [wire.TopLogprob(*_entry(texts, token, lp)) for token, lp in item.top]
        out.append(wire.ChatTokenLogprob(text, item.logprob, raw, top))
    return out


def _entry(texts: TokenTexts, token: int, logprob: float) -> tuple[str, float, list[int]]:
    text, raw = texts(token)
    return text, logprob, raw


class CompletionLogprobs:
    """The legacy completions `logprobs`, built a piece at a time (`take`) so a stream's
    chunks carry their own tokens with offsets into the whole choice text.

    Each `top_logprobs` dict holds the k most likely tokens and the sampled one (OpenAI:
    "up to logprobs + 1 elements"); `text_offset` counts characters from the start of the
    choice's text (after an echoed prompt) over the tokens' own texts, as vLLM counts.
    """

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts, self.offset = texts, offset

    def take(self, items: Sequence[TokenLogprobs]) -> wire.CompletionLogprobs:
        piece = wire.CompletionLogprobs([], [], [], [])
        for item in items:
            text, _ = self.texts(item.token_id)
            top = {self.texts(token)[0]: lp for token, lp in item.top}
            top.setdefault(text, item.logprob)
            piece.tokens.append(text)
            piece.token_logprobs.append(item.logprob)
            piece.top_logprobs.append(top)
            piece.text_offset.append(self.offset)
            self.offset += len(text)
        return piece
