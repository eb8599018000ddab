"""Open a `.ninfer` container: check the prelude, header and volume sizes, map the payload.

`open_container` reads no object bytes: tensors are zero-copy views of `mmap`s
(`ACCESS_COPY`, so they are writable and writing never touches the file), and object
checksums are checked by `NinferArtifact.verify()` on request. See
`docs/artifact-format.md`.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import struct
import sys
from collections.abc import Iterable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ninfer_core.artifact.layout import (
    ARTIFACT_ID_BYTES,
    CHECKSUM_BYTES,
    DEFAULT_COMPONENT,
    MAGIC,
    MAX_HEADER_BYTES,
    PAYLOAD_ALIGN,
    PRELUDE_BYTES,
    VERSIONS,
    Header,
    ObjectRecord,
    align_up,
    decode_header,
    validate_header,
)
from ninfer_core.errors import ArtifactError
from ninfer_core.quant.formats import FORMATS
from ninfer_core.safe_json import loads_limited

_HASH_CHUNK = 16 << 20


def read_header(path: Path) -> tuple[Header, int]:
    """The validated header of `path` and its payload start `P` (sections 1-6 of the spec)."""
    where = str(path)
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(0)
            return _read_header(fh, size, where)
    except OSError as exc:
        raise ArtifactError(f"{where}: cannot read: {exc.strerror or exc}") from None


def _read_header(fh: Any, size: int, where: str) -> tuple[Header, int]:
    head = fh.read(8)
    if head[:7] != MAGIC[: len(head)]:  # a short prefix of the magic is a truncation
        raise ArtifactError(
            f"{where}: not a .ninfer file: it starts with {head!r}, not {MAGIC!r} + version"
        )
    if len(head) < 8:
        raise ArtifactError(f"{where}: truncated prelude: the file is {size} bytes")
    version = head[7]
    if version not in VERSIONS:
        readable = ", ".join(str(v) for v in VERSIONS)
        raise ArtifactError(
            f"{where}: .ninfer container version {version}; this build reads versions {readable}"
        )
    prelude_len = PRELUDE_BYTES[version]
    rest = fh.read(prelude_len - 8)
    if len(rest) < prelude_len - 8:
        raise ArtifactError(
            f"{where}: truncated prelude: the file is {size} bytes, a version {version} "
            f"prelude needs {prelude_len}"
        )
    (header_len,) = struct.unpack("<Q", rest[:8])
    artifact_id = rest[8 : 8 + ARTIFACT_ID_BYTES] if version >= 3 else None
    header_end = prelude_len + header_len
    payload_start = align_up(header_end + CHECKSUM_BYTES, PAYLOAD_ALIGN)
    if header_len > MAX_HEADER_BYTES or payload_start > size:
        raise ArtifactError(
            f"{where}: header length {header_len} does not fit: with its checksum and padding "
            f"it needs {payload_start} bytes, the file is {size} bytes (truncated or corrupt; "
            f"the limit is {MAX_HEADER_BYTES})"
        )
    raw = fh.read(header_len)
    checksum = fh.read(CHECKSUM_BYTES)
    digest = hashlib.sha256(head + rest)
    digest.update(raw)
    if checksum != digest.digest():
        raise ArtifactError(f"{where}: header checksum mismatch: the prelude or header is damaged")
    padding = fh.read(payload_start - header_end - CHECKSUM_BYTES)
    if padding.count(0) != len(padding):
        raise ArtifactError(f"{where}: nonzero byte in the padding after the header")
    doc = decode_header(raw, where)
    try:
        header = validate_header(doc, version=version, artifact_id=artifact_id, where=where)
    except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
        # Every rule has its own message; this net keeps a case we did not foresee one line.
        raise ArtifactError(f"{where}: malformed header ({type(exc).__name__}: {exc})") from None
    return header, payload_start


def volume_path(path: Path, volume: int, header: Header) -> Path:
    """The file holding `volume`: the main file, or `<main name>.part-NNNN` beside it."""
    if volume == 0:
        return path
    return path.with_name(f"{path.name}.{header.volumes[volume - 1].name}")


def _check_size(where: str, header: Header, volume: int, available: int, expected: int):
    if available < expected:
        cut = next(o for o in header.objects if o.volume == volume and o.end > available)
        raise ArtifactError(
            f"{where}: truncated: object {cut.name!r} at payload bytes [{cut.offset}, "
            f"{cut.end}) runs past the end (the payload has {available} of {expected} bytes)"
        )
    if available > expected:
        raise ArtifactError(
            f"{where}: {available - expected} trailing bytes after the last object "
            f"(the payload should be {expected} bytes)"
        )


def _map(file: Path) -> mmap.mmap:
    with file.open("rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)


def open_container(path: str | Path, *, components: Iterable[str] | None = None) -> NinferArtifact:
    """Open and check `path`; only tensors of `components` (default `{"text"}`) are loadable.

    Every problem is an `ArtifactError` naming the file and what is wrong.
    """
    path = Path(path)
    if sys.byteorder != "little":
        raise ArtifactError(f"{path}: .ninfer tensors are little-endian; this host is not")
    header, payload_start = read_header(path)
    wanted = {DEFAULT_COMPONENT} if components is None else set(components)
    unknown = sorted(wanted - header.components.keys())
    if unknown:
        raise ArtifactError(
            f"{path}: no component {unknown[0]!r} in this file; "
            f"it has: {', '.join(header.components) or 'none'}"
        )
    maps: list[tuple[mmap.mmap | None, int]] = []
    for volume in range(len(header.volumes) + 1):
        file = volume_path(path, volume, header)
        base = payload_start if volume == 0 else 0
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise ArtifactError(
                f"{path}: missing volume file {file.name} "
                f"(volume {volume} of {len(header.volumes)})"
            ) from None
        except OSError as exc:
            raise ArtifactError(f"{file}: cannot read: {exc.strerror or exc}") from None
        _check_size(str(file), header, volume, size - base, header.volume_end(volume))
        try:
            maps.append((_map(file) if size else None, base))
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{file}: cannot map: {exc}") from None
    return NinferArtifact(path, header, maps, frozenset(wanted))


class NinferArtifact:
    """An opened `.ninfer` container (implements `ninfer_core.plugin_types.Artifact`)."""

    def __init__(
        self,
        path: Path,
        header: Header,
        maps: list[tuple[mmap.mmap | None, int]],
        enabled: frozenset[str],
    ) -> None:
        self.path = path
        self.header = header
        self.enabled = enabled
        self._maps: list[tuple[mmap.mmap | None, int]] | None = maps
        self._objects = {o.name: o for o in header.objects}

    # --- what the file is ------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def identity(self) -> dict[str, str] | None:
        return self.header.identity

    @property
    def recipe(self) -> dict[str, Any] | None:
        return self.header.recipe

    @property
    def artifact_id(self) -> bytes | None:
        """The 16-byte id of a version 3 file; None before version 3."""
        return self.header.artifact_id

    @property
    def components(self) -> dict[str, str]:
        """Every component in the file, name -> description (`enabled` says which load)."""
        return dict(self.header.components)

    def object_table(self) -> list[ObjectRecord]:
        """Every object of the file in payload order, enabled or not (for `ninfer inspect`)."""
        return list(self.header.objects)

    @contextlib.contextmanager
    def with_components(self, names: Iterable[str]) -> Iterator[NinferArtifact]:
        """This file with `names` enabled too (those it has), for a `with` block: reopened
        (a header read and maps, no tensor data) and closed at the block's end; weights
        loaded from it stay valid, each view keeping its map alive."""
        wanted = self.enabled | (set(names) & set(self.components))
        if wanted == self.enabled:
            yield self
            return
        with open_container(self.path, components=wanted) as reopened:
            yield reopened

    @cached_property
    def config(self) -> dict[str, Any]:
        text = self.read_text("config.json")
        if text is None:
            raise ArtifactError(f"{self.path}: no config.json resource (a model needs one)")
        try:
            data = loads_limited(text)
        except ValueError as exc:
            raise ArtifactError(f"{self.path}: config.json is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ArtifactError(f"{self.path}: config.json is not a JSON object")
        return data

    # --- tensors ---------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Tensors of the enabled components, in payload order."""
        return [
            o.name
            for o in self.header.objects
            if o.kind == "tensor" and o.component in self.enabled
        ]

    def _tensor(self, name: str) -> ObjectRecord:
        rec = self._objects.get(name)
        if rec is None or rec.kind != "tensor":
            raise ArtifactError(f"{self.path}: no tensor {name!r} in the container")
        if rec.component not in self.enabled:
            raise ArtifactError(
                f"{self.path}: tensor {name!r} belongs to component {rec.component!r}, "
                f"which is not enabled (open with components including {rec.component!r})"
            )
        return rec

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The logical shape (a quantized tensor's `[rows, cols]`, not its byte count)."""
        return self._tensor(name).shape or ()

    def tensor_format(self, name: str) -> str:
        return self._tensor(name).format or ""

    def tensor_file(self, name: str) -> Path:
        """The file holding the tensor's bytes (for error messages)."""
        return volume_path(self.path, self._tensor(name).volume, self.header)

    def load_raw(self, name: str) -> torch.Tensor:
        """The stored bytes of a tensor (of an enabled component) or resource: 1-D uint8."""
        rec = self._objects.get(name)
        if rec is None:
            raise ArtifactError(f"{self.path}: no object {name!r} in the container")
        if rec.kind == "tensor":
            self._tensor(name)
        return self._view(rec)

    def load_weight(self, name: str) -> Any:
        """A dense tensor (a view, in its stored dtype), or a `QuantizedTensor`."""
        rec = self._tensor(name)
        fmt = FORMATS[rec.format or ""]
        raw = self._view(rec)
        shape = rec.shape or ()
        if fmt.quantized:
            from ninfer_core.quant.tensor import QuantizedTensor

            return QuantizedTensor.from_stored(fmt.name, shape, raw)
        return raw.view(fmt.dtype).reshape(shape)

    def load_tensor(self, name: str) -> torch.Tensor:
        """Dense: the stored tensor (a view). Quantized: dequantized to float32.

        Views of one opened container share memory: writing into one (allowed; the file
        never changes) shows in the next load of that name. Clone before changing in place.
        """
        weight = self.load_weight(name)
        return weight if isinstance(weight, torch.Tensor) else weight.dequantize()

    def _view(self, rec: ObjectRecord) -> torch.Tensor:
        if self._maps is None:
            raise ArtifactError(f"{self.path}: the container is closed")
        if rec.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        mm, base = self._maps[rec.volume]
        return torch.frombuffer(mm, dtype=torch.uint8, count=rec.nbytes, offset=base + rec.offset)

    # --- resources -------------------------------------------------------------------

    def resource_names(self) -> list[str]:
        return [o.name for o in self.header.objects if o.kind == "resource"]

    def read_resource(self, name: str) -> bytes | None:
        rec = self._objects.get(name)
        if rec is None or rec.kind != "resource":
            return None
        if self._maps is None:
            raise ArtifactError(f"{self.path}: the container is closed")
        mm, base = self._maps[rec.volume]
        return mm[base + rec.offset : base + rec.end] if mm is not None else b""

    def read_text(self, name: str) -> str | None:
        data = self.read_resource(name)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ArtifactError(f"{self.path}: resource {name!r} is not UTF-8 ({exc})") from None

    # --- integrity, lifetime ---------------------------------------------------------

    def verify(self) -> list[str]:
        """Hash every object (all components) and check the gaps between them are zero.

        Returns one line per problem, each naming the file and the object; [] when sound.
        """
        if self._maps is None:
            raise ArtifactError(f"{self.path}: the container is closed")
        problems: list[str] = []
        ends: dict[int, tuple[int, str]] = {}
        for rec in self.header.objects:
            mm, base = self._maps[rec.volume]
            file = volume_path(self.path, rec.volume, self.header)
            gap_start, before = ends.get(rec.volume, (0, "the start of the payload"))
            if mm is not None and rec.offset > gap_start:
                gap = mm[base + gap_start : base + rec.offset]
                if gap.count(0) != len(gap):
                    problems.append(
                        f"{file}: nonzero bytes in the alignment gap between {before} "
                        f"and object {rec.name!r}"
                    )
            ends[rec.volume] = (rec.end, f"object {rec.name!r}")
            digest = hashlib.sha256()
            if mm is not None:
                with memoryview(mm) as view:
                    for start in range(rec.offset, rec.end, _HASH_CHUNK):
                        stop = min(start + _HASH_CHUNK, rec.end)
                        with view[base + start : base + stop] as chunk:
                            digest.update(chunk)
            if digest.hexdigest() != rec.sha256:
                problems.append(
                    f"{file}: object {rec.name!r} (volume {rec.volume}, payload bytes "
                    f"[{rec.offset}, {rec.end})) is corrupt: its sha256 is "
                    f"{digest.hexdigest()}, the header says {rec.sha256}"
                )
        return problems

    def close(self) -> None:
        """Drop the maps. Tensors already loaded stay valid: each view keeps its map alive
        (closing an mmap under a live `torch.frombuffer` view would crash, so we never do)."""
        self._maps = None

    def __enter__(self) -> NinferArtifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
