"""Typed, range-checked reads of `config.json` fields.

A model's config is untrusted input, and every number in it sizes something: a tensor, a
loop over layers, a division in RoPE. `int("1e9")` or `float("inf")` would be accepted by a
plain cast and fail much later, after gigabytes were allocated or as a NaN in every logit.
So each field is read once, here, with its type and range, and a bad one is a
`ModelLoadError` naming the field, the value and what it should be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ninfer_core.errors import ModelLoadError, elided

_MISSING = object()


def _show(value: Any) -> str:
    return elided(repr(value))


def as_int(value: Any) -> int | None:
    """`value` as an int when it is one: a JSON integer, or a float with no fraction
    (`4096.0`, which some exporters write); never a bool, a string or inf/NaN."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def as_number(value: Any) -> float | None:
    """`value` as a finite float when it is a JSON number (not a bool, string, inf or NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        return None
    return number if math.isfinite(number) else None


class FieldReader:
    """Reads fields of one JSON object; every failure names `source` and the field."""

    def __init__(self, raw: Mapping[str, Any], source: str, prefix: str = "") -> None:
        self.raw, self.source, self.prefix = raw, source, prefix

    def fail(self, key: str, value: Any, want: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {self.prefix}{key} is {_show(value)}; {want}")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is _MISSING:
            raise ModelLoadError(f"{self.source}: missing required field {self.prefix + key!r}")
        return default

    def int(self, key: str, low: int, high: int, default: Any = _MISSING) -> int:
        """An integer in [low, high]."""
        value = self.get(key, default)
        number = as_int(value)
        if number is None or not low <= number <= high:
            raise self.fail(key, value, f"it must be an integer from {low:,} to {high:,}")
        return number

    def number(
        self, key: str, *, above: float, high: float = math.inf, default: Any = _MISSING
    ) -> float:
        """A finite number greater than `above` and at most `high`."""
        value = self.get(key, default)
        number = as_number(value)
        if number is None or not above < number <= high:
            bound = "" if high == math.inf else f" and at most {high:g}"
            raise self.fail(key, value, f"it must be a finite number above {above:g}{bound}")
        return number

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, value, "it must be true or false")
        return value

    def text(self, key: str, default: Any = _MISSING) -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            raise self.fail(key, value, "it must be a string")
        return value

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        """An id or a list of ids (null: none), each within the vocabulary."""
        value = self.get(key, None)
        items = [] if value is None else value if isinstance(value, list) else [value]
        ids = [as_int(v) for v in items]
        if any(i is None or not 0 <= i < vocab_size for i in ids):
            raise self.fail(
                key, value, f"it must be a token id or a list of them, each below {vocab_size:,}"
            )
        return tuple(i for i in ids if i is not None)
