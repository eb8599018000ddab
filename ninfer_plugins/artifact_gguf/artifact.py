"""`GGUFArtifact`: one opened `.gguf` file as an `Artifact` (config, tensors, text files)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import torch

from ninfer_core.errors import ModelLoadError
from ninfer_core.quant.formats import weight_format
from ninfer_core.quant.widen import common_format
from ninfer_plugins.artifact_gguf import tensors
from ninfer_plugins.artifact_gguf.config import PERMUTED_QK, architecture, hf_config
from ninfer_plugins.artifact_gguf.file import GGUFFormatError, read_gguf
from ninfer_plugins.artifact_gguf.metadata import Metadata
from ninfer_plugins.artifact_gguf.tokenizer import GGUFVocabulary

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GGUFTensorRecord:
    """One tensor as the file stores it (`object_table`, `ninfer inspect`)."""

    #: the Hugging Face name it is served under
    name: str
    #: its name in the file
    gguf_name: str
    #: the ggml type (`Q4_1`, `F32`, ...)
    format: str
    #: torch order
    shape: tuple[int, ...]
    nbytes: int


#: ggml's dense types -> our format names.
_DENSE_FORMATS = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}
#: Projections the dense family fuses into one matrix (q|k|v, gate|up): the parts of one
#: layer's group must share a format, so a group is kept only when all of it can be.
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_FUSED_PART = re.compile(r"(model\.layers\.\d+\.(?:self_attn|mlp)\.)(\w+)(\.weight)")


def _kept_formats(named: dict[str, Any]) -> dict[str, str]:
    """Hugging Face name -> our format for each tensor kept in its ggml codes: every
    matrix of a type `ggml.kept_format` keeps (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4). The parts
    of a fused group whose formats differ (say q and k in Q4_K, v in Q6_K, as llama.cpp's
    Q4_K_M writes some layers) are all held in one format that holds each of them exactly
    (`quant.widen`); a group with a part that loads dense loads dense."""
    kept = {}
    for name, tensor in named.items():
        fmt = tensors.kept_format(tensor)
        if fmt is not None:
            kept[name] = fmt
    for name in list(kept):
        match = _FUSED_PART.fullmatch(name)
        group = next((g for g in _FUSED if match and match[2] in g), None)
        if group is None:
            continue
        parts = [f"{match[1]}{part}{match[3]}" for part in group]
        present = [p for p in parts if p in named]
        formats = {kept.get(p) for p in present}
        if len(formats) == 1:
            continue
        common = None if None in formats else common_format(weight_format(f) for f in formats)
        if common is None:
            for p in present:
                kept.pop(p, None)
        else:
            kept.update(dict.fromkeys(present, common.name))
    return kept


class GGUFArtifact:
    """An opened GGUF file. The header is parsed at open (which tensors stay in their ggml
    blocks is decided there, `_kept_formats`); tensors are read one at a time from the
    memory-mapped file when asked for."""

    #: One file: messages about a tensor name `path`.
    tensor_file = None
    with_components = None  # one file, every tensor listed

    def __init__(self, path: Path) -> None:
        self.path = path
        reader = self._checked(lambda: read_gguf(path))
        self._reader = reader
        self.meta = Metadata(reader)
        self.architecture = self._checked(lambda: architecture(self.meta))
        self._tensors: dict[str, Any] = {}
        for tensor in reader.tensors:
            self._checked(lambda t=tensor: tensors.check_type(t))
            name = self._checked(lambda t=tensor: tensors.hf_name(t.name))
            if name in self._tensors:
                raise ModelLoadError(f"{path}: two tensors are served as {name!r}")
            self._tensors[name] = tensor
        rows = {t.name: int(t.shape[-1]) if len(t.shape) else 1 for t in reader.tensors}
        context = self._checked(lambda: self.meta.int(f"{self.architecture}.context_length"))
        self.vocabulary = GGUFVocabulary(self.meta, context)
        tokens = self._checked(
            lambda: len(self.vocabulary.tokens) if "tokenizer.ggml.tokens" in self.meta else None
        )
        self.config: dict[str, Any] = self._checked(
            lambda: hf_config(self.meta, self.architecture, rows, tokens)
        )
        #: name -> our quantized format, for the tensors `load_weight` keeps in their blocks
        self._kept = _kept_formats(self._tensors)

    def _checked(self, step: Callable[[], T]) -> T:
        """Run `step`; a format problem becomes a `ModelLoadError` naming the file."""
        try:
            return step()
        except GGUFFormatError as exc:
            raise ModelLoadError(f"{self.path}: {exc}") from None

    # -- tensors ---------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: no tensor {name!r} in the file")
        return tensor

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tensors.torch_shape(self._tensor(name))

    def _heads(self, name: str) -> int | None:
        """For llama.cpp's permuted Q/K rows: how many heads to unpermute over."""
        if self.architecture not in PERMUTED_QK:
            return None
        key = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}
        for proj, field in key.items():
            if f".self_attn.{proj}." in name:
                heads = self.config.get(field)
                if not isinstance(heads, int):
                    raise ModelLoadError(f"{self.path}: {field} is unknown; cannot load {name!r}")
                return heads
        return None

    def tensor_format(self, name: str) -> str:
        """The format `load_weight` hands the tensor out in: `Q4G32`, `Q4G32M`, `W8G32`, ...
        for one kept in its ggml codes, else the dense one (`fp32` for a dequantized type)."""
        kept = self._kept.get(name)
        if kept is not None:
            return kept
        return _DENSE_FORMATS.get(self._tensor(name).tensor_type.name, "fp32")

    def load_tensor(self, name: str) -> torch.Tensor:
        """Dense, on the CPU: F32/F16/BF16 as stored, a quantized tensor dequantized to float32."""
        tensor = self._tensor(name)
        return self._checked(lambda: tensors.load(tensor, self._heads(name), keep_as=None))

    def load_weight(self, name: str) -> Any:
        """The tensor as the model holds it: a `QuantizedTensor` where `tensor_format` names a
        quantized format (the ggml blocks as they are), else as `load_tensor`."""
        tensor = self._tensor(name)
        keep = self._kept.get(name)
        return self._checked(lambda: tensors.load(tensor, self._heads(name), keep_as=keep))

    def object_table(self) -> list[GGUFTensorRecord]:
        """Every tensor with its ggml type, torch shape and stored bytes (nothing is read)."""
        return [
            GGUFTensorRecord(
                name=name,
                gguf_name=t.name,
                format=t.tensor_type.name,
                shape=tensors.torch_shape(t),
                nbytes=int(t.n_bytes),
            )
            for name, t in self._tensors.items()
        ]

    # -- text files ------------------------------------------------------------------------

    @cached_property
    def _texts(self) -> dict[str, Callable[[], str | None]]:
        vocab = self.vocabulary
        if not vocab.present:
            return {"config.json": lambda: json.dumps(self.config, indent=2)}
        return {
            "config.json": lambda: json.dumps(self.config, indent=2),
            "tokenizer.json": vocab.tokenizer_json,
            "tokenizer_config.json": vocab.tokenizer_config_json,
            "generation_config.json": vocab.generation_config_json,
        }

    def read_text(self, name: str) -> str | None:
        """`config.json`, and the tokenizer files built from the metadata; None otherwise."""
        build = self._texts.get(name)
        if build is None:
            return None
        cache = self.__dict__.setdefault("_text_cache", {})
        if name not in cache:
            cache[name] = self._checked(build)
        return cache[name]

    def metadata_summary(self) -> dict[str, Any]:
        """A few facts for `ninfer inspect`: architecture, name, file type, tokenizer."""
        keys = ("general.name", "general.file_type", "tokenizer.ggml.model", "tokenizer.ggml.pre")
        out: dict[str, Any] = {"architecture": self.architecture}
        for key in keys:
            value = self._checked(
                lambda k=key: self.meta.int(k) if k.endswith("file_type") else self.meta.str(k)
            )
            if value is not None:
                out[key] = value
        return out

    def close(self) -> None:
        """Drop the file's map (views already handed out keep it alive)."""
        self._tensors.clear()
        self._reader = None  # type: ignore[assignment]
