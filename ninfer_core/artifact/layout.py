"""The `.ninfer` byte layout: constants, records, and header validation.

`docs/artifact-format.md` is the spec; this module is its checker. Header values come
from an untrusted file, so every number is checked as a Python int (no overflow) before
anything is sized by it, and every problem is one `ArtifactError` line naming the file.
The `*_problem` helpers return a message or None, so the writer can refuse the same
things with a `ValueError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer_core.errors import ArtifactError, elided
from ninfer_core.quant.formats import FORMATS

MAGIC = b"NINFER\0"
VERSIONS = (1, 2, 3)
#: Prelude bytes before the header: magic + version, u64 header length, v3: artifact id.
PRELUDE_BYTES = {1: 16, 2: 16, 3: 32}
ARTIFACT_ID_BYTES = 16
CHECKSUM_BYTES = 32
PAYLOAD_ALIGN = 4096
OBJECT_ALIGN = 256
MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 8
MAX_NUMEL = 1 << 48
MAX_NAME_CHARS = 1024
MAX_VOLUMES = 9999
DEFAULT_COMPONENT = "text"
#: Descriptions the writer uses for the usual component names.
COMPONENT_DESCRIPTIONS = {
    "text": "the language model",
    "mtp": "multi-token prediction layers",
    "vision": "the vision encoder",
    "draft": "a draft model for speculative decoding",
}

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_COMPONENT = re.compile(r"[a-z][a-z0-9_-]{0,63}")
_SURROGATE = re.compile("[\ud800-\udfff]")

_TOP_KEYS = {
    1: ({"format_version", "objects"}, set()),
    2: ({"format_version", "objects"}, {"identity", "recipe"}),
    3: (
        {"format_version", "objects", "artifact_id", "volumes", "components"},
        {"identity", "recipe"},
    ),
}
_COMMON_KEYS = {"name", "kind", "offset", "nbytes", "sha256"}


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def part_name(volume: int) -> str:
    """The header name of continuation volume `volume` (1-based): `part-0001`, ..."""
    return f"part-{volume:04d}"


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """One payload object: a tensor (with format and logical shape) or a resource."""

    name: str
    kind: str  # "tensor" | "resource"
    offset: int  # from the payload start of its volume
    nbytes: int
    sha256: str
    volume: int = 0
    component: str | None = None  # tensors only
    format: str | None = None  # tensors only
    shape: tuple[int, ...] | None = None  # tensors only

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_json(self, version: int) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "tensor":
            if version >= 3:
                doc["component"] = self.component
            doc["format"] = self.format
            doc["shape"] = list(self.shape or ())
        if version >= 3:
            doc["volume"] = self.volume
        doc.update(offset=self.offset, nbytes=self.nbytes, sha256=self.sha256)
        return doc


@dataclass(frozen=True, slots=True)
class Volume:
    """A continuation file: `name` is `part-NNNN`, `nbytes` its size."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A validated header. Versions 1 and 2 read as one volume and a `text` component."""

    version: int
    objects: tuple[ObjectRecord, ...]
    identity: dict[str, str] | None = None
    recipe: dict[str, Any] | None = None
    artifact_id: bytes | None = None
    volumes: tuple[Volume, ...] = ()
    components: dict[str, str] = field(
        default_factory=lambda: {DEFAULT_COMPONENT: COMPONENT_DESCRIPTIONS[DEFAULT_COMPONENT]}
    )

    def volume_end(self, volume: int) -> int:
        """Where the last object of `volume` ends (0 when it holds none)."""
        ends = [o.end for o in self.objects if o.volume == volume]
        return ends[-1] if ends else 0

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"format_version": self.version}
        if self.version >= 3:
            doc["artifact_id"] = (self.artifact_id or b"").hex()
        if self.version >= 2:
            if self.identity is not None:
                doc["identity"] = dict(self.identity)
            if self.recipe is not None:
                doc["recipe"] = self.recipe
        if self.version >= 3:
            doc["components"] = [{"name": n, "description": d} for n, d in self.components.items()]
            doc["volumes"] = [{"name": v.name, "nbytes": v.nbytes} for v in self.volumes]
        doc["objects"] = [o.to_json(self.version) for o in self.objects]
        return doc

    def encode(self) -> bytes:
        text = json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8")


# --- checks shared with the writer (a message, or None) ---------------------------------


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def name_problem(name: Any) -> str | None:
    if not isinstance(name, str):
        return f"a name must be a string, not {_kind(name)}"
    if not name or len(name) > MAX_NAME_CHARS:
        return f"a name must have 1 to {MAX_NAME_CHARS} characters, not {len(name)}"
    if not _is_unicode(name):
        return f"a name must be valid Unicode text, not {name!r} (it has a lone surrogate)"
    return None


def _is_unicode(text: str) -> bool:
    """False for a str holding a lone surrogate (JSON's `"\\ud800"` decodes to one): it cannot
    be written as UTF-8, so printing it (`ninfer inspect`) would crash."""
    return text.isascii() or not _SURROGATE.search(text)


def format_problem(fmt: Any) -> str | None:
    if not isinstance(fmt, str) or fmt not in FORMATS:
        return f"unknown weight format {fmt!r}; known formats: {', '.join(FORMATS)}"
    return None


def shape_problem(fmt: str, shape: Any) -> str | None:
    """None when `shape` is a list of sane ints that format `fmt` (known) can store."""
    if not isinstance(shape, list | tuple):
        return f"shape must be a list of integers, not {_kind(shape)}"
    if len(shape) > MAX_DIMS:
        return f"shape {_short(shape)} has {len(shape)} dimensions, more than {MAX_DIMS}"
    numel = 1
    for d in shape:
        if type(d) is not int:
            return f"shape {_short(shape)} has a dimension that is {_kind(d)}, not an integer"
        if d < 0 or d > MAX_NUMEL:
            return f"shape {_short(shape)} has a dimension {d} outside 0 .. 2**48"
        numel *= d
    if numel > MAX_NUMEL:
        return f"shape {_short(shape)} has {numel} elements, more than 2**48 (absurd dimensions)"
    if FORMATS[fmt].quantized and len(shape) != 2:
        return f"format {fmt} stores 2-D [rows, cols] tensors, not shape {list(shape)}"
    return None


def component_problem(name: Any) -> str | None:
    if not isinstance(name, str) or not _COMPONENT.fullmatch(name):
        return f"component name {name!r} must match [a-z][a-z0-9_-]{{0,63}}"
    return None


def identity_problem(identity: Any) -> str | None:
    if identity is None:
        return None
    if not isinstance(identity, Mapping):
        return f"identity must be an object {{model_id, weights_id}}, not {_kind(identity)}"
    if set(identity) != {"model_id", "weights_id"}:
        return (
            f"identity must have exactly the keys model_id and weights_id, not {sorted(identity)}"
        )
    for key in ("model_id", "weights_id"):
        if not isinstance(identity[key], str):
            return f"identity.{key} must be a string, not {_kind(identity[key])}"
    return None


def recipe_problem(recipe: Any) -> str | None:
    if recipe is not None and not isinstance(recipe, Mapping):
        return f"recipe must be a JSON object, not {_kind(recipe)}"
    return None


def _short(value: Any) -> str:
    return elided(json.dumps(value) if isinstance(value, list | tuple) else repr(value), 80)


# --- reading -----------------------------------------------------------------------------


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise ValueError(f"the key {key!r} appears twice in one object")
        doc[key] = value
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def decode_header(raw: bytes, where: str) -> dict[str, Any]:
    """The header bytes as a JSON object; anything else is an `ArtifactError`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"{where}: header is not valid UTF-8 ({exc})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except RecursionError:
        raise ArtifactError(f"{where}: header is not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, duplicate keys, huge integers
        raise ArtifactError(f"{where}: header is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ArtifactError(f"{where}: header JSON is {_kind(doc)}, not an object")
    if (bad := _first_surrogate(doc)) is not None:
        raise ArtifactError(
            f"{where}: header string {bad} is not valid Unicode text (a lone surrogate)"
        )
    return doc


def _first_surrogate(doc: Any) -> str | None:
    """The first string (key or value) of `doc` with a lone surrogate, or None; iterative,
    so a deep document cannot exhaust the stack here."""
    todo = [doc]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                return _short(value)
        elif isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return None


class _Checker:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, problem: str) -> ArtifactError:
        return ArtifactError(f"{self.where}: {problem}")

    def check(self, problem: str | None, context: str = "") -> None:
        if problem is not None:
            raise self.fail(f"{context}{problem}")

    def keys(self, doc: dict[str, Any], required: set[str], optional: set[str], what: str):
        missing = sorted(required - doc.keys())
        if missing:
            raise self.fail(f"{what} lacks {', '.join(repr(k) for k in missing)}")
        unknown = sorted(doc.keys() - required - optional)
        if unknown:
            raise self.fail(f"{what} has unknown key {unknown[0]!r}")

    def integer(self, value: Any, what: str, *, minimum: int = 0) -> int:
        if type(value) is not int:
            raise self.fail(f"{what} must be an integer, not {_kind(value)}")
        if value < minimum:
            raise self.fail(f"{what} is {value}; it must be at least {minimum} (negative?)")
        return value

    def items(self, value: Any, what: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(f"{what} must be a list, not {_kind(value)}")
        return value

    def object(self, value: Any, what: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} must be an object, not {_kind(value)}")
        return value


def validate_header(
    doc: dict[str, Any], *, version: int, artifact_id: bytes | None, where: str
) -> Header:
    """Check a decoded header against the spec for `version` (the prelude's version byte)."""
    c = _Checker(where)
    required, optional = _TOP_KEYS[version]
    c.keys(doc, required, optional, "header")
    fv = c.integer(doc["format_version"], "header format_version")
    if fv != version:
        raise c.fail(f"header format_version {fv} differs from the prelude's version {version}")

    identity = doc.get("identity")
    c.check(identity_problem(identity), "header ")
    recipe = doc.get("recipe")
    c.check(recipe_problem(recipe), "header ")

    volumes: tuple[Volume, ...] = ()
    components = {DEFAULT_COMPONENT: COMPONENT_DESCRIPTIONS[DEFAULT_COMPONENT]}
    if version >= 3:
        hex_id = doc["artifact_id"]
        if not isinstance(hex_id, str) or not _HEX32.fullmatch(hex_id):
            raise c.fail(f"header artifact_id must be 32 lowercase hex digits, not {hex_id!r}")
        if artifact_id is None or bytes.fromhex(hex_id) != artifact_id:
            found = artifact_id.hex() if artifact_id else None
            raise c.fail(f"header artifact_id {hex_id} differs from the prelude's {found}")
        volumes = _volumes(c, doc["volumes"])
        components = _components(c, doc["components"])

    objects = _objects(c, c.items(doc["objects"], "header objects"), version, volumes, components)
    header = Header(
        version=version,
        objects=objects,
        identity=dict(identity) if identity is not None else None,
        recipe=recipe,
        artifact_id=artifact_id if version >= 3 else None,
        volumes=volumes,
        components=components,
    )
    for k, vol in enumerate(volumes, start=1):
        end = header.volume_end(k)
        if vol.nbytes != end:
            raise c.fail(
                f"volume {vol.name} is declared as {vol.nbytes} bytes but its objects end at {end}"
            )
    return header


def _volumes(c: _Checker, value: Any) -> tuple[Volume, ...]:
    entries = c.items(value, "header volumes")
    if len(entries) > MAX_VOLUMES:
        raise c.fail(f"header lists {len(entries)} volumes, more than {MAX_VOLUMES}")
    volumes = []
    for k, entry in enumerate(entries, start=1):
        what = f"volume {k}"
        entry = c.object(entry, what)
        c.keys(entry, {"name", "nbytes"}, set(), what)
        if entry["name"] != part_name(k):
            raise c.fail(f"{what} is named {entry['name']!r}; it must be {part_name(k)!r}")
        volumes.append(Volume(part_name(k), c.integer(entry["nbytes"], f"{what} nbytes")))
    return tuple(volumes)


def _components(c: _Checker, value: Any) -> dict[str, str]:
    components: dict[str, str] = {}
    for i, entry in enumerate(c.items(value, "header components")):
        what = f"component {i}"
        entry = c.object(entry, what)
        c.keys(entry, {"name", "description"}, set(), what)
        name, description = entry["name"], entry["description"]
        c.check(component_problem(name), f"{what}: ")
        if not isinstance(description, str):
            raise c.fail(f"component {name!r} description must be a string")
        if name in components:
            raise c.fail(f"duplicate component name {name!r}")
        components[name] = description
    return components


def _objects(
    c: _Checker,
    entries: Sequence[Any],
    version: int,
    volumes: tuple[Volume, ...],
    components: dict[str, str],
) -> tuple[ObjectRecord, ...]:
    records: list[ObjectRecord] = []
    seen: set[str] = set()
    last: dict[int, ObjectRecord] = {}
    for i, entry in enumerate(entries):
        entry = c.object(entry, f"object {i}")
        name = entry.get("name")
        c.check(name_problem(name), f"object {i}: ")
        what = f"object {name!r}"
        kind = entry.get("kind")
        if kind not in ("tensor", "resource"):
            raise c.fail(f"{what} has kind {kind!r}; expected 'tensor' or 'resource'")
        required = set(_COMMON_KEYS)
        if kind == "tensor":
            required |= {"format", "shape"}
        if version >= 3:
            required |= {"volume", "component"} if kind == "tensor" else {"volume"}
        c.keys(entry, required, set(), what)
        if name in seen:
            raise c.fail(f"duplicate object name {name!r}")
        seen.add(name)

        offset = c.integer(entry["offset"], f"{what} offset")
        nbytes = c.integer(entry["nbytes"], f"{what} nbytes")
        if offset % OBJECT_ALIGN:
            raise c.fail(f"{what} offset {offset} is misaligned (not a multiple of {OBJECT_ALIGN})")
        digest = entry["sha256"]
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise c.fail(f"{what} sha256 must be 64 lowercase hex digits")
        volume = 0
        if version >= 3:
            volume = c.integer(entry["volume"], f"{what} volume")
            if volume > len(volumes):
                raise c.fail(
                    f"{what} is in volume {volume}, but the header lists "
                    f"{len(volumes)} continuation volumes"
                )
        fmt = shape = component = None
        if kind == "tensor":
            fmt = entry["format"]
            c.check(format_problem(fmt), f"{what}: ")
            c.check(shape_problem(fmt, entry["shape"]), f"{what}: ")
            shape = tuple(entry["shape"])
            expected = FORMATS[fmt].stored_nbytes(shape)
            if nbytes != expected:
                raise c.fail(
                    f"{what} nbytes {nbytes} does not match its shape {list(shape)} in {fmt}, "
                    f"which takes {expected} bytes"
                )
            component = entry["component"] if version >= 3 else DEFAULT_COMPONENT
            if not isinstance(component, str) or component not in components:
                raise c.fail(
                    f"{what} names component {component!r}, which the header does not list "
                    f"(listed: {', '.join(components) or 'none'})"
                )
        record = ObjectRecord(name, kind, offset, nbytes, digest, volume, component, fmt, shape)
        if records and volume < records[-1].volume:
            raise c.fail(f"{what} is listed after volume {records[-1].volume}'s objects")
        prev = last.get(volume)
        if prev is not None and offset < prev.end:
            if offset < prev.offset:
                raise c.fail(
                    f"{what} at offset {offset} is listed after {prev.name!r} at offset "
                    f"{prev.offset}: objects must be in offset order"
                )
            raise c.fail(
                f"{what} at bytes [{offset}, {offset + nbytes}) overlaps {prev.name!r} "
                f"at [{prev.offset}, {prev.end}) in volume {volume}"
            )
        last[volume] = record
        records.append(record)
    return tuple(records)
