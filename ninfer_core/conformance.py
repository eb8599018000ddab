"""Does an object keep its protocol's contract? Checked once, before it is used.

The protocols in `ninfer_core.plugin_types` list every member the core uses. A
member is *required* (a method, a property, an annotation without a default) or
*optional* (an annotation with a default in the protocol body): an optional member
must still be declared, and may hold the default. For each method, and each
optional callable that is not None, the object's signature must accept the call
the core makes: required parameters by position, optional ones by name, as the
protocol's signature spells them (`inspect.Signature.bind`). A malformed object is
found here, at startup, not deep inside a request.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, Protocol

from ninfer_core import plugin_types
from ninfer_core.errors import NInferError

_MISSING = object()
_P = inspect.Parameter


class ContractError(NInferError):
    """An object does not keep the contract of its kind."""


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a protocol and how it is checked."""

    name: str
    kind: Literal["method", "data", "optional"]
    #: What the core calls it with (methods and optional callables), without `self`.
    signature: inspect.Signature | None = None


def _strip_self(fn: Callable[..., Any]) -> inspect.Signature:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1:]
    return sig.replace(parameters=params)


def _callable_shape(annotation: str) -> inspect.Signature | None:
    """The `__call__` signature of the callback protocol an optional member is typed with."""
    for word in re.findall(r"[A-Za-z_]\w*", annotation):
        shape = getattr(plugin_types, word, None)
        if isinstance(shape, type) and "__call__" in vars(shape):
            return _strip_self(vars(shape)["__call__"])
    return None


@cache
def members(protocol: type) -> tuple[Member, ...]:
    """Every public member of `protocol` (its own and inherited), in declaration order."""
    found: dict[str, Member] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        body = vars(cls)
        for name, annotation in body.get("__annotations__", {}).items():
            if name in body:
                found[name] = Member(name, "optional", _callable_shape(str(annotation)))
            else:
                found[name] = Member(name, "data")
        for name, value in body.items():
            if name.startswith("_") or name in found:
                continue
            if inspect.isfunction(value):
                found[name] = Member(name, "method", _strip_self(value))
            elif isinstance(value, property):
                found[name] = Member(name, "data")
    return tuple(found.values())


def _stub(obj: object, protocol: type, name: str) -> bool:
    """True when `obj` subclasses the protocol and inherits a method's `...` body."""
    found = inspect.getattr_static(type(obj), name, None)
    return any(vars(c).get(name) is found for c in protocol.__mro__ if found is not None)


def call_problem(name: str, fn: Any, expected: inspect.Signature) -> str:
    """Why `fn` cannot be called the way the core calls `name`, or ""."""
    if not callable(fn):
        return f"{name} is not callable"
    try:
        actual = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: cannot tell
        return ""
    args: list[object] = []
    required: dict[str, object] = {}
    optional: dict[str, object] = {}
    for p in expected.parameters.values():
        if p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            continue
        if p.default is _P.empty and p.kind is not _P.KEYWORD_ONLY:
            args.append(p.name)
        elif p.default is _P.empty:
            required[p.name] = p.name
        else:
            optional[p.name] = p.name
    for kwargs in (required, {**required, **optional}):
        try:
            actual.bind(*args, **kwargs)
        except TypeError as exc:
            return f"{name}{_plain(actual)} cannot be called as {name}{_plain(expected)}: {exc}"
    return ""


def _plain(sig: inspect.Signature) -> str:
    """`(layout, device, compute_dtype=None)`: the signature without annotations."""
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


_VALUED = frozenset({"name", "description", "priority", "architectures", "error_paths"})


def _value_problem(name: str, value: Any) -> str:
    """Checks on the few data members whose type the core relies on at once."""
    if name in ("name", "description"):
        ok, want = isinstance(value, str) and bool(value), "a non-empty string"
    elif name == "priority":
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an int"
    else:  # architectures, error_paths
        ok = isinstance(value, tuple | list) and all(isinstance(v, str) for v in value)
        want = "a tuple of strings"
    return "" if ok else f"{name} is {value!r}, not {want}"


def problems(obj: object, protocol: type) -> list[str]:
    """Everything `obj` lacks of `protocol`'s contract; empty when it conforms."""
    out: list[str] = []
    for m in members(protocol):
        if inspect.getattr_static(obj, m.name, _MISSING) is _MISSING:
            hint = " (declare it; its default says what the core does without it)"
            out.append(f"no {m.name}" + (hint if m.kind == "optional" else ""))
            continue
        if m.kind == "method" and _stub(obj, protocol, m.name):
            out.append(f"{m.name} is not implemented (only the protocol's stub)")
            continue
        if m.kind == "data" or (m.kind == "optional" and m.signature is None):
            # Only values the core relies on at once are read (a property may do work).
            problem = _value_problem(m.name, getattr(obj, m.name)) if m.name in _VALUED else ""
            if problem:
                out.append(problem)
            continue
        value = getattr(obj, m.name)
        if m.kind == "optional" and value is None:
            problem = ""
        else:
            assert m.signature is not None
            problem = call_problem(m.name, value, m.signature)
        if problem:
            out.append(problem)
    return out


def check(obj: object, protocol: type, what: str) -> None:
    """Raise `ContractError` naming `what` (e.g. "the model built by family 'qwen3'")."""
    found = problems(obj, protocol)
    if found:
        raise ContractError(f"{what} ({obj!r}) is not a {protocol.__name__}: {'; '.join(found)}")
