"""Artifact reader for Hugging Face model folders: config.json + safetensors shards.

Model files are untrusted input: headers are parsed and checked before any tensor
is read, and pickle-based checkpoints (`.bin`, `.pt`) are refused, never loaded.
Mixture-of-experts weights stored stacked (`mlp.experts.gate_up_proj`, the Hub's
Qwen3.5-MoE) are listed as one matrix per expert (`ninfer_core.model.stacked_experts`).
"""

from __future__ import annotations

import struct
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ninfer_core import hookimpl
from ninfer_core.errors import ModelLoadError
from ninfer_core.model.stacked_experts import ExpertSlice, split_stacked
from ninfer_core.safe_json import loads_limited
from ninfer_core.support import Support

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: A safetensors header larger than this is treated as corrupt (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    """The tensor records of one safetensors file, checked against the file's size."""
    size = file.stat().st_size
    with file.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{file}: corrupt safetensors header: file is {size} bytes")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise ModelLoadError(
                f"{file}: corrupt safetensors header: header length {length} "
                f"does not fit in a {size}-byte file"
            )
        raw = fh.read(length)
    try:
        header = loads_limited(raw.decode("utf-8"), max_chars=MAX_HEADER_BYTES)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{file}: corrupt safetensors header: not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file}: corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    for name, rec in header.items():
        try:
            begin, end = rec["data_offsets"]
            dtype, shape = rec["dtype"], rec["shape"]
        except (KeyError, TypeError, ValueError):
            msg = f"{file}: corrupt safetensors header: bad record {name!r}"
            raise ModelLoadError(msg) from None
        if dtype not in _DTYPES:
            raise ModelLoadError(f"{file}: tensor {name!r} has unsupported dtype {dtype}")
        numel = 1
        for dim in shape:
            numel *= int(dim)
        expected = numel * _DTYPES[dtype].itemsize
        if not 0 <= begin <= end <= data_size or end - begin != expected:
            raise ModelLoadError(
                f"{file}: corrupt safetensors header: tensor {name!r} spans bytes "
                f"[{begin}, {end}) but needs {expected} bytes within {data_size}"
            )
    return header


class HFFolderArtifact:
    """An opened Hugging Face model folder.

    A stacked experts tensor is not listed itself: each expert's matrix is, under the
    name a per-expert checkpoint gives it, and reading one reads only its slice of the
    file, so loading, planning and `ninfer convert` (which quantizes each matrix) see
    one layout whichever the folder stores."""

    # Optional `Artifact` members it does without: weights are dense tensors
    # (`load_tensor`), every tensor in its stored dtype, sizes from the shapes.
    load_weight = None
    tensor_format = None
    object_table = None
    with_components = None  # a folder lists every tensor

    def __init__(self, path: Path) -> None:
        self.path = path
        self._where: dict[str, Path] = {}
        self._records: dict[str, dict[str, Any]] = {}
        for file in self._weight_files():
            for name, rec in read_safetensors_header(file).items():
                self._where[name] = file
                self._records[name] = rec
        self._experts = self._split_experts()
        stacked = {part.source for part in self._experts.values()}
        self._names = [n for n in self._records if n not in stacked] + list(self._experts)
        self._handles: dict[Path, Any] = {}

    def _split_experts(self) -> dict[str, ExpertSlice]:
        """Per-expert name -> its slice of a stacked tensor; a folder holding some
        expert both ways is refused (which copy would load is anyone's guess)."""
        shapes = {n: tuple(int(d) for d in rec["shape"]) for n, rec in self._records.items()}
        try:
            experts = split_stacked(shapes)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path}: {exc}") from None
        for name, part in experts.items():
            if name in self._records:
                raise ModelLoadError(
                    f"{self._where[name]}: tensor {name!r} is also stored stacked in "
                    f"{part.source!r} ({self._where[part.source].name}): one layout, please"
                )
        return experts

    @cached_property
    def config(self) -> dict[str, Any]:
        file = self.path / "config.json"
        try:
            data = loads_limited(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelLoadError(f"{file}: missing (a model folder needs config.json)") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise ModelLoadError(f"{file}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ModelLoadError(f"{file}: expected a JSON object")
        return data

    def _weight_files(self) -> list[Path]:
        index = self.path / INDEX_NAME
        if index.exists():
            try:
                weight_map = loads_limited(index.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (KeyError, TypeError, ValueError) as exc:  # UnicodeDecodeError too
                raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from None
            files = [self.path / n for n in names]
            for f in files:
                if not f.is_file():
                    raise ModelLoadError(f"{index}: names shard {f.name}, which is missing")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            return files
        pickled = sorted(p.name for p in self.path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise ModelLoadError(
                f"{self.path / pickled[0]}: pickle checkpoints are refused (loading them can run "
                "arbitrary code); convert the model to safetensors, e.g. with transformers' "
                "`save_pretrained(..., safe_serialization=True)`"
            )
        raise ModelLoadError(f"{self.path}: no *.safetensors weight files found")

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def tensor_file(self, name: str) -> Path:
        part = self._experts.get(name)
        return self._where[name if part is None else part.source]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        part = self._experts.get(name)
        if part is not None:
            return part.shape
        return tuple(int(d) for d in self._records[name]["shape"])

    def load_tensor(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        part = self._experts.get(name)
        stored = name if part is None else part.source
        file = self._where.get(stored)
        if file is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        try:
            handle = self._handles.get(file)
            if handle is None:
                handle = self._handles[file] = safe_open(str(file), framework="pt")
            if part is None:
                return handle.get_tensor(name)
            # Only this expert's rows are read from the file.
            return handle.get_slice(stored)[part.expert, part.start : part.stop]
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: cannot read tensor {name!r}: {exc}") from None

    def read_text(self, name: str) -> str | None:
        file = self.path / name
        if not file.is_file():
            return None
        return file.read_text(encoding="utf-8")

    def close(self) -> None:
        self._handles.clear()


def open_hf_folder(path: str | Path) -> HFFolderArtifact:
    """Open a model folder; any problem is a `ModelLoadError` naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path / 'config.json'}: missing (a model folder needs config.json)")
    return HFFolderArtifact(path)


class SafetensorsFolderReader:
    name = "hf-safetensors"
    description = "Hugging Face model folder: config.json + *.safetensors (+ index)"

    def supports(self, device: Any) -> Support:
        return Support.yes("reads on the CPU; any device")

    def can_read(self, path: Path) -> bool:
        return path.is_dir() and (path / "config.json").is_file()

    def open(self, path: Path) -> HFFolderArtifact:
        return open_hf_folder(path)


@hookimpl
def register_artifact_readers() -> list[SafetensorsFolderReader]:
    return [SafetensorsFolderReader()]
