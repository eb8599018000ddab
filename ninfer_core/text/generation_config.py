"""The model's `generation_config.json`: which tokens end a turn, and its sampling defaults.

Chat models often end a turn with a token other than the tokenizer's eos (Qwen3 stops on
both `<|im_end|>` and `<|endoftext|>`), and their authors publish the sampling settings they
evaluated with. Both live here; a request's own settings override the defaults.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ninfer_core.errors import ModelLoadError
from ninfer_core.plugin_types import Artifact
from ninfer_core.safe_json import loads_limited

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty")
_INT_FIELDS = ("top_k", "max_new_tokens")


def token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id`-style value (an int, a list of ints, or null) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, bool):
        raise ValueError(f"expected a token id, got {value!r}")
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ValueError(f"expected a token id or a list of them, got {value!r}")


#: The fields a request's sampling settings override, in `SamplingParams` spelling.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """What `generation_config.json` says; None where it says nothing."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    #: False means the authors decode greedily unless a request asks otherwise
    do_sample: bool | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GenerationDefaults:
        """Parse the JSON object; raises ValueError naming the field that is wrong."""
        fields: dict[str, Any] = {}
        try:
            fields["eos_token_ids"] = token_ids(raw.get("eos_token_id"))
        except ValueError as exc:
            raise ValueError(f"eos_token_id: {exc}") from None
        for name in (*_FLOAT_FIELDS, *_INT_FIELDS, "do_sample"):
            value = raw.get(name)
            if value is None:
                continue
            if name == "do_sample":
                ok = isinstance(value, bool)
            else:
                ok = isinstance(value, int | float) and not isinstance(value, bool)
                ok = ok and (name in _FLOAT_FIELDS or float(value).is_integer())
            if not ok:
                raise ValueError(f"{name}: unexpected value {value!r}")
            fields[name] = float(value) if name in _FLOAT_FIELDS else value
            if name in _INT_FIELDS:
                fields[name] = int(value)
        return cls(**fields)

    def sampling_values(self) -> dict[str, Any]:
        """The sampling fields the model's authors set, as `SamplingParams` keywords;
        `do_sample: false` means greedy unless a request says otherwise."""
        values = {n: getattr(self, n) for n in SAMPLING_FIELDS if getattr(self, n) is not None}
        if self.do_sample is False:
            values["temperature"] = 0.0
        return values

    @classmethod
    def from_artifact(cls, artifact: Artifact) -> GenerationDefaults:
        """The model's defaults; empty when it ships no `generation_config.json`."""
        text = artifact.read_text("generation_config.json")
        if text is None:
            return cls()
        where = str(getattr(artifact, "path", "the model"))
        try:
            raw = loads_limited(text)
            if not isinstance(raw, dict):
                raise ValueError("it should hold a JSON object")
            return cls.from_dict(raw)
        except ValueError as exc:  # JSONDecodeError is a ValueError too
            raise ModelLoadError(
                f"generation_config.json in {where} is not usable: {exc}"
            ) from None


def stop_token_ids(
    generation: GenerationDefaults,
    model_config: Mapping[str, Any] | None = None,
    tokenizer_eos_id: int | None = None,
) -> tuple[int, ...]:
    """Every token that ends a turn: generation_config's eos ids, then config.json's, then
    the tokenizer's eos, each once, in that order."""
    sources: list[Iterable[int]] = [generation.eos_token_ids]
    if model_config is not None:
        try:
            # multimodal configs keep the language model's ids under text_config
            text_config = model_config.get("text_config") or {}
            value = model_config.get("eos_token_id", text_config.get("eos_token_id"))
            sources.append(token_ids(value))
        except ValueError as exc:
            raise ModelLoadError(f"config.json eos_token_id: {exc}") from None
    if tokenizer_eos_id is not None:
        sources.append((tokenizer_eos_id,))
    return tuple(dict.fromkeys(i for ids in sources for i in ids))
