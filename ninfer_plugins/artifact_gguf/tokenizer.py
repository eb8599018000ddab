"""`tokenizer.json`, `tokenizer_config.json` and `generation_config.json` from a GGUF's
`tokenizer.*` metadata, so the text layer reads a GGUF like a Hugging Face folder.

A GGUF stores its vocabulary as llama.cpp uses it: `tokenizer.ggml.model` (the algorithm;
`gpt2` is byte-level BPE), `.tokens` and `.merges` (already in the byte-level alphabet),
`.token_type` (1 normal, 3 control, 4 user-defined, ...), `.pre` (which pre-tokenizer
regex the merges were learned with), the special token ids, `.add_bos_token`, and the chat
template as `tokenizer.chat_template`. The facts follow transformers' GGUF conversion
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`) and llama.cpp's
`llama-vocab.cpp` for the pre-tokenizers.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

from ninfer_core.text.byte_level import byte_to_char
from ninfer_plugins.artifact_gguf.file import GGUFFormatError
from ninfer_plugins.artifact_gguf.metadata import Metadata

#: `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
CONTROL, USER_DEFINED = 3, 4

# Pre-tokenizer regexes, as llama.cpp splits for each `tokenizer.ggml.pre` (llama-vocab.cpp).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: "gpt2": GPT-2's own regex (the `ByteLevel` pre-tokenizer's); "digits": each digit split off
#: first, then GPT-2's regex (llama.cpp's SMOLLM/STARCODER/REFACT group; SmolLM's own
#: tokenizer.json says the same with `Digits(individual_digits=True)`); else a regex.
PRE_TOKENIZERS: dict[str, str] = {
    "gpt2": "gpt2",
    # llama.cpp's "default" adds splits of its own; transformers reads it as GPT-2, as we do
    "default": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
#: Pre-tokenizers whose vocabulary entries win over merges (llama.cpp's `ignore_merges`).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3"})


class GGUFVocabulary:
    """The tokenizer metadata of one file, read once; builds the JSON files on demand."""

    def __init__(self, meta: Metadata, context_length: int | None = None) -> None:
        self.meta = meta
        self.model = meta.str("tokenizer.ggml.model")
        self.context_length = context_length

    @property
    def present(self) -> bool:
        return self.model is not None

    @cached_property
    def tokens(self) -> list[str]:
        tokens = self.meta.array("tokenizer.ggml.tokens", "str")
        if not tokens:
            raise GGUFFormatError("tokenizer.ggml.tokens is missing or empty")
        return tokens

    def _token_id(self, key: str) -> int | None:
        """`tokenizer.ggml.{key}`, checked against the vocabulary; None when absent."""
        token_id = self.meta.int(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(self.tokens):
            raise GGUFFormatError(
                f"tokenizer.ggml.{key}={token_id} is outside the "
                f"{len(self.tokens):,}-token vocabulary"
            )
        return token_id

    def _token(self, key: str) -> str | None:
        token_id = self._token_id(key)
        return None if token_id is None else self.tokens[token_id]

    def tokenizer_json(self) -> str:
        """The `tokenizers` JSON: byte-level BPE with the file's vocabulary, merges,
        pre-tokenizer, added tokens and bos/eos post-processing."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
        from tokenizers.models import BPE

        if self.model != "gpt2":
            raise GGUFFormatError(
                f"tokenizer.ggml.model {self.model!r} is not supported yet; supported: "
                "gpt2 (byte-level BPE)"
            )
        pre = self.meta.str("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise GGUFFormatError(
                f"tokenizer.ggml.pre {pre!r} names a pre-tokenizer NInfer does not know; "
                f"known: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        tokens = self.tokens
        types = self.meta.array("tokenizer.ggml.token_type", "int") or []
        merges = self._merges()
        alphabet = byte_to_char()
        spelt = set(alphabet.values())
        # Tokens are stored in the byte alphabet already; one that is not (an added token
        # written as plain text) is spelt in it, as transformers does.
        vocab = {
            t if set(t) <= spelt else "".join(alphabet[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        try:
            model = BPE(
                vocab=vocab,
                merges=merges,
                fuse_unk=False,
                ignore_merges=pre in _IGNORE_MERGES,
            )
        except Exception as exc:  # the Rust side: a merge naming a token not in the vocab
            raise GGUFFormatError(f"tokenizer.ggml.merges do not fit the tokens: {exc}") from None
        tok = Tokenizer(model)
        split = PRE_TOKENIZERS[pre]
        if split == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif split == "digits":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        # Control tokens (`<|im_end|>`) are special; user-defined ones (`<think>`) are matched
        # whole but are text. A control token spelt outside the byte alphabet is a llama.cpp
        # mislabel (transformers skips it too): it stays an ordinary vocabulary entry.
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == CONTROL and set(t) <= spelt
        ]
        plain = [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED
        ]
        tok.add_special_tokens(special)
        tok.add_tokens(plain)
        tok.post_processor = self._post_processor(processors)
        return tok.to_str()

    def _merges(self) -> list[tuple[str, str]]:
        merges = []
        for merge in self.meta.array("tokenizer.ggml.merges", "str") or []:
            left, sep, right = merge.partition(" ")
            if not sep or not left or not right or " " in right:
                raise GGUFFormatError(f"tokenizer.ggml.merges holds a malformed merge {merge!r}")
            merges.append((left, right))
        return merges

    def _post_processor(self, processors: Any) -> Any:
        """What `encode(text)` adds around the text: the bos and eos tokens when the file says
        to add them (`tokenizer.ggml.add_bos_token` / `add_eos_token`); None: nothing."""
        added: dict[str, tuple[str, int]] = {}
        for key in ("bos", "eos"):
            if self.meta.bool(f"tokenizer.ggml.add_{key}_token", False):
                token_id = self._token_id(f"{key}_token_id")
                if token_id is None:
                    raise GGUFFormatError(f"tokenizer.ggml.add_{key}_token without {key}_token_id")
                added[key] = (self.tokens[token_id], token_id)
        if not added:
            return None
        bos = [added["bos"][0]] if "bos" in added else []
        eos = [added["eos"][0]] if "eos" in added else []
        second = [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
        return processors.TemplateProcessing(
            single=[*bos, "$A", *eos],
            pair=[*bos, "$A", *eos, *second],
            special_tokens=list(dict.fromkeys(added.values())),
        )

    def tokenizer_config_json(self) -> str:
        """The special tokens by name, whether bos/eos are added, and the chat template."""
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            config[name] = self._token(key)
        config["add_bos_token"] = self.meta.bool("tokenizer.ggml.add_bos_token", False)
        config["add_eos_token"] = self.meta.bool("tokenizer.ggml.add_eos_token", False)
        if self.context_length is not None:
            config["model_max_length"] = self.context_length
        template = self.meta.str("tokenizer.chat_template")
        if template is not None:
            config["chat_template"] = template
        return json.dumps(config, ensure_ascii=False, indent=2)

    def generation_config_json(self) -> str | None:
        """The tokens that end a turn when llama.cpp's metadata names more than eos
        (`eot_token_id`, `eom_token_id`); None when eos is the only one."""
        ids = [
            token_id
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (token_id := self._token_id(key)) is not None
        ]
        ids = list(dict.fromkeys(ids))
        if len(ids) < 2:
            return None
        config: dict[str, Any] = {"eos_token_id": ids}
        if (bos := self._token_id("bos_token_id")) is not None:
            config["bos_token_id"] = bos
        return json.dumps(config, indent=2)
