"""Write a `.ninfer` container, one object at a time (see `docs/artifact-format.md` §8).

    with ContainerWriter("model.ninfer", identity={...}) as w:
        w.add_resource("config.json", config_text)
        w.add_tensor("model.norm.weight", "bf16", (64,), norm_weight)

Each object's bytes are written and hashed as soon as it is added, so peak memory is one
tensor. Volume 0's payload goes to `X.ninfer.payload.tmp` until `close()` knows the
header; the finished file is assembled as `X.ninfer.tmp` and renamed over `X.ninfer`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import operator
import os
import shutil
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ninfer_core.artifact.layout import (
    ARTIFACT_ID_BYTES,
    COMPONENT_DESCRIPTIONS,
    DEFAULT_COMPONENT,
    MAGIC,
    MAX_VOLUMES,
    OBJECT_ALIGN,
    PAYLOAD_ALIGN,
    VERSIONS,
    Header,
    ObjectRecord,
    Volume,
    align_up,
    component_problem,
    decode_header,
    format_problem,
    identity_problem,
    name_problem,
    part_name,
    recipe_problem,
    shape_problem,
    validate_header,
)
from ninfer_core.quant.formats import FORMATS

_CHUNK = 16 << 20
_ZEROS = bytes(max(OBJECT_ALIGN, PAYLOAD_ALIGN))

Data = torch.Tensor | bytes | bytearray | memoryview


def _byte_view(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A contiguous CPU copy-or-self of `t` and a zero-copy byte view of it (no numpy).

    The view does not own the memory: keep the returned tensor alive while using it."""
    t = t.detach().cpu().contiguous().reshape(-1)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t, memoryview(b"")
    buf = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    return t, memoryview(buf).cast("B")


def _bytes_view(data: Any, what: str) -> memoryview:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"{what}: data must be bytes, str or a tensor, not {type(data).__name__}")
    try:
        return memoryview(data).cast("B")
    except TypeError as exc:
        raise ValueError(f"{what}: data must be contiguous bytes ({exc})") from None


class _Volume:
    def __init__(self, tmp: Path, final: Path | None) -> None:
        self.tmp, self.final = tmp, final
        self.fh: BinaryIO = tmp.open("wb")
        self.size = 0
        self.count = 0


class ContainerWriter:
    """Streams tensors and resources into a `.ninfer` file of `version` 1, 2 or 3."""

    def __init__(
        self,
        path: str | Path,
        *,
        version: int = 3,
        identity: Mapping[str, str] | None = None,
        recipe: Mapping[str, Any] | None = None,
        artifact_id: bytes | None = None,
        volume_limit: int | None = None,
        components: Mapping[str, str] | None = None,
    ) -> None:
        """`components` gives descriptions (name -> text) for version 3 components; the
        usual names (`text`, `mtp`, `vision`, `draft`) have default descriptions."""
        if version not in VERSIONS:
            raise ValueError(f"cannot write .ninfer version {version}; versions: {VERSIONS}")
        if version < 2 and (identity is not None or recipe is not None):
            raise ValueError("a version 1 .ninfer has no identity or recipe; use version 2 or 3")
        if version < 3 and (
            artifact_id is not None or volume_limit is not None or components is not None
        ):
            raise ValueError("artifact_id, volume_limit and components need a version 3 .ninfer")
        for problem in (identity_problem(identity), recipe_problem(recipe)):
            if problem:
                raise ValueError(problem)
        if recipe is not None:
            try:
                recipe = json.loads(json.dumps(dict(recipe), allow_nan=False))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"recipe is not plain JSON: {exc}") from None
        if artifact_id is None and version >= 3:
            artifact_id = os.urandom(ARTIFACT_ID_BYTES)
        if artifact_id is not None and (
            not isinstance(artifact_id, bytes) or len(artifact_id) != ARTIFACT_ID_BYTES
        ):
            raise ValueError(f"artifact_id must be {ARTIFACT_ID_BYTES} bytes")
        if volume_limit is not None and (type(volume_limit) is not int or volume_limit <= 0):
            raise ValueError(f"volume_limit must be a positive int, not {volume_limit!r}")
        self.path = Path(path)
        self.version = version
        self.identity = dict(identity) if identity is not None else None
        self.recipe = recipe
        self.artifact_id = artifact_id
        self.volume_limit = volume_limit
        self._components: dict[str, str] = {
            DEFAULT_COMPONENT: COMPONENT_DESCRIPTIONS[DEFAULT_COMPONENT]
        }
        for name, description in (components or {}).items():
            if problem := component_problem(name):
                raise ValueError(problem)
            self._components[name] = str(description)
        self._objects: list[ObjectRecord] = []
        self._names: set[str] = set()
        self._closed = self._finished = False
        self._renamed: list[Path] = []  # parts already in place, removed if the end fails
        self._volumes = [_Volume(self._sibling(".payload.tmp"), None)]

    def _sibling(self, suffix: str) -> Path:
        return self.path.with_name(self.path.name + suffix)

    # --- adding objects --------------------------------------------------------------

    def add_tensor(
        self,
        name: str,
        fmt: str,
        shape: Sequence[int],
        data: Data,
        component: str = DEFAULT_COMPONENT,
    ) -> ObjectRecord:
        """Add a tensor of weight format `fmt` and logical `shape`.

        `data` is the stored bytes (a 1-D torch.uint8 tensor, or bytes) of exactly
        `stored_nbytes(shape)`, or for a dense format a tensor of that format's dtype and
        `shape`.
        """
        if problem := format_problem(fmt):
            raise ValueError(f"tensor {name!r}: {problem}")
        try:  # ints and int-likes (torch.Size, numpy ints); not floats, strings or bools
            shape = tuple(d if isinstance(d, bool) else operator.index(d) for d in shape)
        except TypeError:
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of ints") from None
        if problem := shape_problem(fmt, shape):
            raise ValueError(f"tensor {name!r}: {problem}")
        if problem := component_problem(component):
            raise ValueError(f"tensor {name!r}: {problem}")
        if self.version < 3 and component != DEFAULT_COMPONENT:
            raise ValueError(
                f"tensor {name!r}: component {component!r} needs a version 3 .ninfer "
                f"(versions 1 and 2 hold only {DEFAULT_COMPONENT!r})"
            )
        wf = FORMATS[fmt]
        nbytes = wf.stored_nbytes(shape)
        if isinstance(data, torch.Tensor) and data.dtype != torch.uint8:
            if wf.quantized or data.dtype != wf.dtype:
                want = f"{wf.dtype} or " if not wf.quantized else ""
                raise ValueError(
                    f"tensor {name!r}: {fmt} data must be {want}torch.uint8 stored bytes, "
                    f"not {data.dtype}"
                )
            if tuple(data.shape) != shape:
                raise ValueError(
                    f"tensor {name!r}: data has shape {list(data.shape)}, not {list(shape)}"
                )
        elif isinstance(data, torch.Tensor) and data.dim() != 1:
            raise ValueError(f"tensor {name!r}: stored bytes must be a 1-D uint8 tensor")
        if isinstance(data, torch.Tensor):
            owner, view = _byte_view(data)  # `owner` keeps the bytes alive until written
        else:
            owner, view = data, _bytes_view(data, f"tensor {name!r}")
        if view.nbytes != nbytes:
            raise ValueError(
                f"tensor {name!r}: {fmt} {list(shape)} takes {nbytes} bytes, got {view.nbytes}"
            )
        self._components.setdefault(component, COMPONENT_DESCRIPTIONS.get(component, ""))
        record = self._add(name, view, kind="tensor", format=fmt, shape=shape, component=component)
        del owner
        return record

    def add_resource(self, name: str, data: bytes | str) -> ObjectRecord:
        """Add a file the model needs (`config.json`, `tokenizer.json`, ...); str is UTF-8."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        return self._add(name, _bytes_view(data, f"resource {name!r}"), kind="resource")

    def _add(self, name: str, view: memoryview, *, kind: str, **tensor: Any) -> ObjectRecord:
        if self._closed:
            raise ValueError(f"{self.path}: the writer is closed")
        if problem := name_problem(name):
            raise ValueError(problem)
        if name in self._names:
            raise ValueError(f"{self.path}: duplicate object name {name!r}")
        index, vol = self._volume_for(view.nbytes)
        offset = align_up(vol.size, OBJECT_ALIGN)
        vol.fh.write(_ZEROS[: offset - vol.size])
        digest = hashlib.sha256()
        for start in range(0, view.nbytes, _CHUNK):
            chunk = view[start : start + _CHUNK]
            digest.update(chunk)
            vol.fh.write(chunk)
        vol.size = offset + view.nbytes
        vol.count += 1
        record = ObjectRecord(
            name, kind, offset, view.nbytes, digest.hexdigest(), volume=index, **tensor
        )
        self._objects.append(record)
        self._names.add(name)
        return record

    def _volume_for(self, nbytes: int) -> tuple[int, _Volume]:
        vol = self._volumes[-1]
        limit = self.volume_limit
        if (
            limit is not None
            and nbytes > 0
            and vol.count > 0
            and align_up(vol.size, OBJECT_ALIGN) + nbytes > limit
        ):
            k = len(self._volumes)
            if k > MAX_VOLUMES:
                raise ValueError(f"{self.path}: more than {MAX_VOLUMES} volumes")
            final = self._sibling(f".{part_name(k)}")
            vol = _Volume(final.with_name(final.name + ".tmp"), final)
            self._volumes.append(vol)
        return len(self._volumes) - 1, vol

    # --- finishing -------------------------------------------------------------------

    def header(self) -> Header:
        """The header as it stands (what `close()` writes)."""
        return Header(
            version=self.version,
            objects=tuple(self._objects),
            identity=self.identity,
            recipe=self.recipe,
            artifact_id=self.artifact_id,
            volumes=tuple(Volume(part_name(k), v.size) for k, v in enumerate(self._volumes[1:], 1)),
            components=dict(self._components),
        )

    def close(self) -> None:
        """Finish: write the main file atomically (after renaming the continuation files)."""
        if self._closed:
            return
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = self._finished = True

    def _finish(self) -> None:
        header = self.header()
        raw = header.encode()
        # Self-check: what we write must read back (catches a writer bug, not user error).
        validate_header(
            decode_header(raw, str(self.path)),
            version=self.version,
            artifact_id=self.artifact_id,
            where=str(self.path),
        )
        prelude = MAGIC + bytes([self.version]) + struct.pack("<Q", len(raw))
        if self.version >= 3:
            prelude += self.artifact_id or b""
        checksum = hashlib.sha256(prelude + raw).digest()
        head_len = len(prelude) + len(raw) + len(checksum)
        padding = align_up(head_len, PAYLOAD_ALIGN) - head_len

        for vol in self._volumes:
            vol.fh.flush()
            os.fsync(vol.fh.fileno())
            vol.fh.close()
        for vol in self._volumes[1:]:
            os.replace(vol.tmp, vol.final)
            self._renamed.append(vol.final)
        main_tmp = self._sibling(".tmp")
        with main_tmp.open("wb") as out, self._volumes[0].tmp.open("rb") as payload:
            out.write(prelude + raw + checksum + _ZEROS[:padding])
            shutil.copyfileobj(payload, out, _CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.replace(main_tmp, self.path)
        self._volumes[0].tmp.unlink()

    def abort(self) -> None:
        """Stop without writing `path`: close and delete every temporary file."""
        if self._finished:
            return
        self._closed = True
        for vol in self._volumes:
            vol.fh.close()
            vol.tmp.unlink(missing_ok=True)
        self._sibling(".tmp").unlink(missing_ok=True)
        for part in self._renamed:
            part.unlink(missing_ok=True)

    def __enter__(self) -> ContainerWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
