"""Build argparse options from config dataclasses, and config objects back from them."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar, get_args, get_origin

C = TypeVar("C")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the non-None type, whether None is allowed)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()
) -> None:
    """One option per field of dataclass `cls`, with its help, type and choices."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        tp, _ = _base_type(hints[f.name])
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help", "")}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = default
        elif meta.get("action") == "append":
            kwargs["action"] = "append"
            kwargs["default"] = None
        else:
            if get_origin(tp) is typing.Literal:
                kwargs["choices"] = list(get_args(tp))
                kwargs["type"] = type(get_args(tp)[0])
            else:
                kwargs["type"] = tp if tp in (int, float, str) else str
            kwargs["default"] = default
            # a help text that already says its default ("every one this device supports")
            # keeps its own words; an empty default says nothing worth printing
            if default not in (None, "") and "(default" not in kwargs["help"]:
                kwargs["help"] += f" (default: {default})"
        group.add_argument(meta.get("flag", _flag(f.name)), **kwargs)


def config_from_args(cls: type[C], ns: argparse.Namespace) -> C:
    """The dataclass `cls` filled from parsed options (absent ones keep their defaults)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.init and hasattr(ns, f.name):
            value = getattr(ns, f.name)
            if value is None and f.default_factory is not dataclasses.MISSING:
                continue
            values[f.name] = value
    return cls(**values)
