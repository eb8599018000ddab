"""The tokenizer: `tokenizer.json` through the `tokenizers` library, special tokens from the
model's config files, behaving like transformers (5.x) does for the same folder.

Two transformers behaviours are kept on purpose, because prompts must tokenize exactly as
they did when the model was trained and evaluated:

* whether `encode(..., add_special_tokens=True)` adds a bos token is decided by the
  post-processor in `tokenizer.json`. transformers drops `add_bos_token`/`add_eos_token` from
  `tokenizer_config.json` whenever a `tokenizer.json` exists, and so do we;
* a named special token (bos/eos/pad/...) that `tokenizer.json` lacks as an added token is
  added as a special token, so the template's `<s>` is one token, not its spelling.

`clean_up_tokenization_spaces` is never applied: transformers skips it for BPE models, and it
rewrites text (" ." becomes "."), which would make streamed text differ from the final text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from ninfer_core.errors import ModelLoadError
from ninfer_core.plugin_types import Artifact

#: The special tokens transformers names (its `SPECIAL_TOKENS_ATTRIBUTES`), in its order.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized")


def _token_content(value: Any) -> str | None:
    """The text of a special token given as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any) -> AddedToken:
    """An `AddedToken` marked special, keeping the flags of a dict form (lstrip, ...)."""
    if isinstance(value, Mapping):
        flags = {k: bool(value[k]) for k in _ADDED_TOKEN_FLAGS if k in value}
        return AddedToken(value["content"], special=True, **flags)
    return AddedToken(str(value), special=True)


@dataclass(frozen=True)
class SpecialTokens:
    """The model's named special tokens as text, and the raw values they came from."""

    #: name (`bos_token`, `eos_token`, model-specific ones like `image_token`) -> token text
    named: dict[str, str] = field(default_factory=dict)
    #: `extra_special_tokens` / `additional_special_tokens` given as a list
    extra: tuple[str, ...] = ()
    #: the values as written (strings or AddedToken dicts), so flags like lstrip survive
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def bos(self) -> str | None:
        return self.named.get("bos_token")

    @property
    def eos(self) -> str | None:
        return self.named.get("eos_token")

    @property
    def pad(self) -> str | None:
        return self.named.get("pad_token")

    def template_vars(self) -> dict[str, str]:
        """What a chat template sees: `bos_token`, `eos_token`, ... (transformers passes these)."""
        return dict(self.named)

    @classmethod
    def from_configs(
        cls, tokenizer_config: Mapping[str, Any], special_tokens_map: Mapping[str, Any] | None
    ) -> SpecialTokens:
        """Read them as transformers does.

        `special_tokens_map.json` is a legacy file: transformers reads it only when
        `tokenizer_config.json` has no `added_tokens_decoder`, and then its values win.
        """
        values: dict[str, Any] = dict(tokenizer_config)
        if special_tokens_map and "added_tokens_decoder" not in tokenizer_config:
            values.update(special_tokens_map)
        extra_value = values.get("extra_special_tokens") or values.get("additional_special_tokens")
        raw: dict[str, Any] = {}
        for key, value in values.items():
            is_named = key in NAMED_SPECIAL_TOKENS or key.endswith("_token")
            if is_named and _token_content(value) is not None:
                raw[key] = value
        if isinstance(extra_value, Mapping):  # {"image_token": "<|image|>"} names more tokens
            raw.update({k: v for k, v in extra_value.items() if _token_content(v) is not None})
            extra_value = None
        extra = tuple(c for v in extra_value or () if (c := _token_content(v)) is not None)
        order = [k for k in NAMED_SPECIAL_TOKENS if k in raw] + [
            k for k in raw if k not in NAMED_SPECIAL_TOKENS
        ]
        named = {k: _token_content(raw[k]) or "" for k in order}
        return cls(named=named, extra=extra, raw={k: raw[k] for k in order})


#: Texts longer than this (in characters) are counted and encoded in the GIL-releasing way.
PIECE_CHARS = 1 << 16


class TooManyTokensError(ValueError):
    """A text has more tokens than a limit allows (`at_least` of them were counted)."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"the text has at least {at_least} tokens; the limit is {limit}")
        self.at_least, self.limit = at_least, limit


def _piece_end(text: str, start: int) -> int:
    """Where the piece of `text` starting at `start` ends: at most `PIECE_CHARS` on, before
    the last whitespace in its second half when there is one."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    cut = max(
        text.rfind(" ", start + PIECE_CHARS // 2, end),
        text.rfind("\n", start + PIECE_CHARS // 2, end),
    )
    return cut if cut > start else end


def _read_json(read_text: Callable[[str], str | None], name: str, where: str) -> dict[str, Any]:
    """A JSON object file, {} when absent; a broken one is a `ModelLoadError` naming it."""
    from ninfer_core.safe_json import loads_limited

    text = read_text(name)
    if text is None:
        return {}
    try:
        value = loads_limited(text)
    except ValueError as exc:  # bad JSON, or too large or deep (`safe_json`)
        raise ModelLoadError(f"{name} in {where} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{name} in {where} should hold a JSON object")
    return value


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: SpecialTokens,
        tokenizer_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        #: `tokenizer_config.json` as read (the chat template lives there too)
        self.config: dict[str, Any] = dict(tokenizer_config or {})
        self._add_missing_special_tokens()

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> Tokenizer:
        """Load from the model's `tokenizer.json` (required) and its config files."""
        where = str(getattr(artifact, "path", "the model"))
        text = artifact.read_text("tokenizer.json")
        if text is None:
            raise ModelLoadError(
                f"tokenizer.json not found in {where}; NInfer needs it to tokenize"
            )
        try:
            backend = BackendTokenizer.from_str(text)
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"tokenizer.json in {where} could not be loaded: {exc}") from None
        config = _read_json(artifact.read_text, "tokenizer_config.json", where)
        special_map = _read_json(artifact.read_text, "special_tokens_map.json", where)
        return cls(backend, SpecialTokens.from_configs(config, special_map), config)

    def _add_missing_special_tokens(self) -> None:
        # transformers adds every named/extra special token the backend lacks as an added
        # token (reusing the vocab id when the text is already a vocab entry)
        present = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        wanted: list[Any] = [*self.special_tokens.raw.values(), *self.special_tokens.extra]
        missing = [v for v in wanted if _token_content(v) not in present]
        if missing:
            self.backend.add_special_tokens([_added_token(v) for v in missing])

    # -- encoding and decoding ------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = True, *, limit: int | None = None
    ) -> list[int]:
        """Token ids for `text`; with `add_special_tokens`, what the post-processor adds (bos).

        Encode a rendered chat template with `add_special_tokens=False`: the template
        writes its own bos, as transformers' `apply_chat_template` assumes.

        With `limit`, more than `limit` ids raise `TooManyTokensError`, and a long text is
        first counted piece by piece (`count_at_least`), so a text far over the limit costs
        about `limit` tokens' worth of work, not its whole length. A long text is encoded
        through the batch API, which releases the GIL while the Rust side works: a server
        encoding it in a worker thread keeps its event loop running meanwhile.
        """
        if len(text) <= PIECE_CHARS:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            if limit is not None:
                at_least = self.count_at_least(text, limit)
                if at_least > limit:
                    raise TooManyTokensError(at_least, limit)
            ids = self._encode_released(text, add_special_tokens)
        if limit is not None and len(ids) > limit:
            raise TooManyTokensError(len(ids), limit)
        return ids

    def count_at_least(self, text: str, limit: int) -> int:
        """A lower bound on `len(encode(text))`, counted piece by piece and given up as soon as
        it passes `limit` (the text is then over the limit whatever the rest holds).

        Pieces are cut at whitespace where there is some, where tokenizers split anyway; a
        cut can still split a token (or an added token such as `<|im_start|>`) into several,
        so each cut discounts `_cut_slack` tokens from the count to keep it a lower bound.
        """
        count, start, cuts, slack = 0, 0, 0, self._cut_slack
        while start < len(text):
            end = _piece_end(text, start)
            count += len(self._encode_released(text[start:end], False))
            start, cuts = end, cuts + (end < len(text))
            if count - cuts * slack > limit:
                break
        return max(0, count - cuts * slack)

    def _encode_released(self, text: str, add_special_tokens: bool) -> list[int]:
        # `encode` holds the GIL for its whole run (seconds for megabytes); the batch call
        # releases it. `encode_batch_fast` skips the offsets nobody here reads.
        batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def _cut_slack(self) -> int:
        """Tokens one cut between pieces may add at most: a split token becomes at most one
        token per character of it; 16 covers ordinary tokens, added ones may be longer."""
        added = self.backend.get_added_tokens_decoder().values()
        return max([16, *(len(t.content) for t in added)])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`; an incomplete UTF-8 sequence shows as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token given as its vocabulary entry (`<|im_end|>`, `Ġthe`)."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """How many ids this tokenizer knows, added tokens included (transformers' `len()`).

        The model's embedding may be larger (padded); it is never smaller for a sound model.
        """
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- special token ids ----------------------------------------------------------------

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.special_tokens.bos)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.special_tokens.eos)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.special_tokens.pad)

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of every token the backend marks special (what `skip_special_tokens` drops)."""
        decoder = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, t in decoder.items() if t.special)

    @property
    def adds_bos(self) -> bool:
        """Whether `encode(text)` starts with the bos token (so callers avoid a double bos)."""
        bos = self.bos_token_id
        return bos is not None and self.encode("a")[:1] == [bos]
