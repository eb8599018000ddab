"""`SpecConfig`: speculative decoding's options (`--spec`, `--draft-tokens`, `--lm-head-draft`).

`ninfer-serve` and `ninfer generate` generate their options from it. The names are the ones
NInfer deployment guides use (`--spec mtp --draft-tokens 3 --lm-head-draft`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_core.config import opt
from ninfer_core.spec.types import DEFAULT_DRAFT_ROWS, DraftOptions

#: `--draft-tokens` accepts 1..MAX_DRAFT_TOKENS.
MAX_DRAFT_TOKENS = 8
DEFAULT_DRAFT_TOKENS = 3


@dataclass
class SpecConfig:
    """Speculative decoding: which draft strategy, how many drafts per round."""

    spec: str | None = opt(
        None, "speculative decoding strategy: mtp or ngram (see `ninfer probe`); unset: off"
    )
    draft_tokens: int | None = opt(
        None, f"draft tokens per speculative round, 1..{MAX_DRAFT_TOKENS} (default 3)"
    )
    lm_head_draft: bool = opt(
        False,
        "with --spec mtp: draft with a reduced head, the artifact's (`ninfer draft-head`) or, "
        "when it ships none, one built while loading from the head's lowest --draft-vocab ids",
    )
    draft_vocab: int = opt(
        DEFAULT_DRAFT_ROWS,
        "rows of the reduced head --lm-head-draft builds while loading (at most the vocabulary)",
    )

    def __post_init__(self) -> None:
        if self.spec is None:
            given = [
                flag
                for flag, value in (
                    ("--draft-tokens", self.draft_tokens),
                    ("--lm-head-draft", self.lm_head_draft or None),
                )
                if value is not None
            ]
            if given:
                raise ValueError(f"{', '.join(given)} needs --spec (mtp or ngram)")
        if isinstance(self.draft_vocab, bool) or self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be a positive row count, got {self.draft_vocab}")
        k = self.draft_tokens
        if k is not None and (isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS):
            raise ValueError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, got {k}")

    @property
    def enabled(self) -> bool:
        return self.spec not in (None, "none")

    @property
    def options(self) -> DraftOptions:
        return DraftOptions(
            num_tokens=self.draft_tokens or DEFAULT_DRAFT_TOKENS,
            lm_head_draft=self.lm_head_draft,
            draft_vocab=self.draft_vocab,
        )
