"""Typed reads of a GGUF file's metadata (`general.architecture`, `llama.block_count`, ...).

Metadata is untrusted: a key holding a string where a count belongs, or a float where a
token id belongs, is a `GGUFFormatError` naming the key, never a value passed on as it is.
"""

from __future__ import annotations

import math
from typing import Any

from gguf import GGUFReader, GGUFValueType

from ninfer_plugins.artifact_gguf.file import GGUFFormatError

_INTS = {
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
}  # fmt: skip
_FLOATS = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


class Metadata:
    """The key/value section of one opened file."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def _scalar(self, key: str) -> tuple[GGUFValueType, Any] | None:
        field = self._fields.get(key)
        if field is None:
            return None
        kind = field.types[0] if field.types else None
        if kind == GGUFValueType.ARRAY:
            raise GGUFFormatError(f"metadata {key} is an array; a single value is expected")
        try:
            return kind, field.contents()
        except UnicodeDecodeError:
            raise GGUFFormatError(f"metadata {key} is not UTF-8") from None

    def int(self, key: str, default: int | None = None) -> int | None:
        """An integer value (any integer width), or `default` when the key is absent."""
        found = self._scalar(key)
        if found is None:
            return default
        kind, value = found
        if kind not in _INTS:
            raise GGUFFormatError(f"metadata {key} should be an integer, not {kind.name}")
        return int(value)

    def float(self, key: str, default: float | None = None) -> float | None:
        """A finite number (float or integer), or `default` when the key is absent."""
        found = self._scalar(key)
        if found is None:
            return default
        kind, value = found
        if kind not in _FLOATS | _INTS or not math.isfinite(value):
            raise GGUFFormatError(f"metadata {key} should be a finite number, not {value!r}")
        return float(value)

    def bool(self, key: str, default: bool | None = None) -> bool | None:
        found = self._scalar(key)
        if found is None:
            return default
        kind, value = found
        if kind != GGUFValueType.BOOL:
            raise GGUFFormatError(f"metadata {key} should be a boolean, not {kind.name}")
        return bool(value)

    def str(self, key: str, default: str | None = None) -> str | None:
        found = self._scalar(key)
        if found is None:
            return default
        kind, value = found
        if kind != GGUFValueType.STRING:
            raise GGUFFormatError(f"metadata {key} should be a string, not {kind.name}")
        return value

    def array(self, key: str, item: str) -> list[Any] | None:
        """An array of `item` ("str", "int" or "float") values, or None when absent."""
        field = self._fields.get(key)
        if field is None:
            return None
        if not field.types or field.types[0] != GGUFValueType.ARRAY:
            raise GGUFFormatError(f"metadata {key} should be an array")
        if len(field.types) == 1:  # empty: gguf-py records no element type
            return []
        kind = field.types[-1]
        expected = {"str": {GGUFValueType.STRING}, "int": _INTS, "float": _FLOATS | _INTS}[item]
        if kind not in expected:
            raise GGUFFormatError(f"metadata {key} should hold {item} values, not {kind.name}")
        try:
            return field.contents()
        except UnicodeDecodeError:
            raise GGUFFormatError(f"metadata {key} holds a string that is not UTF-8") from None
