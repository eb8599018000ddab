"""How big a template value is, or would become, measured without building it.

The chat-template sandbox (`template_sandbox.py`) refuses an operation whose result
would be too large *before* running it: `'x' * 10**9` must fail without allocating a
gigabyte, and `str(list_of_a_million_refs_to_one_big_string)` must fail without
stringifying it. These functions give the sizes those checks compare with the limits.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

import jinja2.utils

#: A `%` conversion: mapping key, flags, width, precision, length modifier, type.
_PERCENT = re.compile(
    r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])"
)
_DIGITS = re.compile(r"\d+")


class TooLarge(ValueError):
    """A value or an operation's result is larger than the sandbox allows."""


def text_size(value: Any, limit: int) -> int:
    """About `len(str(value))`, counted without building the string; stops counting once
    past `limit` (a list of a million references to one long string is measured by
    visiting each distinct object once)."""
    memo: dict[int, int] = {}

    def size(v: Any) -> int:
        if isinstance(v, str):
            return len(v) + 2
        if v is None or isinstance(v, bool | float):
            return 24
        if isinstance(v, int):
            return v.bit_length() // 3 + 2
        key = id(v)
        if key in memo:
            return memo[key]
        if isinstance(v, jinja2.utils.Namespace):
            v = object.__getattribute__(v, "_Namespace__attrs")
        total = 2
        if isinstance(v, Mapping):
            for k, item in v.items():
                total += size(k) + size(item) + 4
                if total > limit:
                    break
        elif isinstance(v, list | tuple | set | frozenset):
            for item in v:
                total += size(item) + 2
                if total > limit:
                    break
        else:
            total = 64  # a macro, a loop, an Undefined: short reprs
        memo[key] = total
        return total

    return size(value)


def check_text_size(value: Any, limit: int, what: str) -> None:
    """Raise TooLarge when `value` would stringify to more than `limit` characters."""
    if isinstance(value, str):
        if len(value) > limit:
            raise TooLarge(f"{what} would be {len(value):,} characters; the limit is {limit:,}")
        return
    if (size := text_size(value, limit)) > limit:
        raise TooLarge(f"{what} would be over {size:,} characters; the limit is {limit:,}")


def percent_size(fmt: str, args: Any, limit: int) -> int:
    """An upper bound on `len(fmt % args)`: every width and precision, plus, per
    conversion, the largest argument's text."""
    widths = conversions = 0
    for match in _PERCENT.finditer(fmt):
        width, precision, kind = match.groups()
        if "*" in (width, precision):
            raise TooLarge("a '*' width in a % format is not allowed in a chat template")
        widths += int(width or 0) + int(precision or 0)
        conversions += kind != "%"
    items = (
        args.values() if isinstance(args, Mapping) else args if isinstance(args, tuple) else [args]
    )
    largest = max((text_size(a, limit) for a in items), default=0)
    return len(fmt) + widths + conversions * largest


def format_size(fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], limit: int) -> int:
    """An upper bound on `len(fmt.format(*args, **kwargs))`, like `percent_size`."""
    widths = fields = 0
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None:
            continue
        if spec and "{" in spec:
            raise TooLarge("a nested {} in a format spec is not allowed in a chat template")
        widths += sum(int(d) for d in _DIGITS.findall(spec or ""))
        fields += 1
    values = [*args, *kwargs.values()]
    if len(values) == 1 and isinstance(values[0], Mapping):  # format_map
        values = list(values[0].values())
    largest = max((text_size(v, limit) for v in values), default=0)
    return len(fmt) + widths + fields * largest
