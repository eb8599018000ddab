"""A Jinja sandbox that also bounds time and memory, for chat templates from model files.

Jinja's sandbox stops escapes, not exhaustion: `{% for i in range(100000) %}{% for j in
range(100000) %}x...` runs for hours, `{{ 'x' * 10**9 }}` allocates a gigabyte per request
and `{{ 2**10**8 }}` is computed while compiling. `BoundedSandbox` closes each door where
Jinja gives a hook, so no template can do more than `RenderLimits` allows:

- compile: the source length is capped, and `*`, `**`, `+` and `%` are intercepted
  operators, which also stops Jinja folding them as constants at compile time;
- operators: repetition, powers, sums and `%` formatting are sized before they run;
- `~` concatenation, str methods (`format`, `join`, `replace`, `center`...), every filter,
  and the joining of a macro's or block's output size what they would build first;
- everything built is counted against a total for the render, so a loop that keeps what
  it builds runs out of budget instead of memory;
- loops: every `for` iterates through `guard_loop`, which counts iterations over the whole
  render and checks the wall-clock deadline; `range` is capped;
- output: `render_bounded` streams the template and stops at the output limit.

A limit is a `TemplateLimitError` (a Jinja `TemplateError`); `ChatTemplate` turns it into a
one-line `ChatTemplateError`. Time is checked between operations, so the deadline holds to
within one operation, and each operation is bounded in size.
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.nodes as nodes
import jinja2.utils
from jinja2.exceptions import TemplateError
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from ninfer_core.text.template_sizes import (
    TooLarge,
    check_text_size,
    format_size,
    percent_size,
    text_size,
)


@dataclass(frozen=True)
class RenderLimits:
    """What one render of a chat template may use; every bound is far above what real
    templates need (they render a prompt in milliseconds, looping over the messages)."""

    #: Template source characters (real templates: 1-20 KiB).
    max_source_chars: int = 1 << 20
    #: Characters of the output, and of any one string, list text or format result (as
    #: large as the server's 16 MiB body limit; a prompt that long fits no served context).
    max_chars: int = 16 << 20
    #: Characters of all the strings (and items of all the lists) one render builds,
    #: freed or not: what bounds the memory of a loop that keeps what it builds.
    max_total_chars: int = 128 << 20
    #: Elements of one list or tuple a template builds (`[x] * n`, `a + b`, `list(s)`).
    max_items: int = 1 << 20
    #: Integer arguments of filters and str methods (`center(n)`, `indent(n)`, `batch(n)`).
    max_int_arg: int = 1 << 20
    #: Bits of an integer built by `*`, `**` or `+`.
    max_int_bits: int = 1 << 16
    #: Elements of one `range()`.
    max_range: int = 100_000
    #: Loop iterations in one render, all loops together.
    max_iterations: int = 4_000_000
    #: Wall-clock seconds for one render.
    max_seconds: float = 5.0


class TemplateLimitError(TemplateError):
    """A chat template went past a `RenderLimits` bound."""


class _Budget:
    """The running totals of one render: iterations, characters built, the deadline."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.iterations = self.built = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"rendering took longer than {self.limits.max_seconds:g} s")

    def step(self) -> None:
        self.iterations += 1
        if self.iterations > self.limits.max_iterations:
            raise TemplateLimitError(
                f"loops ran more than {self.limits.max_iterations:,} iterations"
            )
        if not self.iterations & 255:
            self.tick()

    def build(self, size: int) -> None:
        self.built += size
        if self.built > self.limits.max_total_chars:
            raise TemplateLimitError(
                f"the template built more than {self.limits.max_total_chars:,} characters"
            )


#: The budget of the render running in this thread or task (None: compiling, or a bare call).
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "ninfer_template_budget", default=None
)


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: Filters that take a string as text; every other filter given a string iterates its
#: characters, so a long one would become a list of that many strings.
_TEXT_FILTERS = _names(
    "abs attr capitalize center count d default e escape filesizeformat first float "
    "forceescape format indent int last length lower pprint random replace reverse round "
    "safe string striptags title tojson trim truncate upper urlencode urlize wordcount "
    "wordwrap xmlattr"
)
#: Filters that do not stringify their value (the others' input is sized first).
_NON_TEXT_FILTERS = _names(
    "abs attr batch count d default dictsort first float groupby int items last length list "
    "map max min random reject rejectattr reverse round select selectattr slice sort sum unique"
)
#: Filters whose output can be many times their input: sized by `_text_filter_size`.
_MULTIPLYING_FILTERS = _names("center format indent join replace tojson wordwrap")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every unbounded operation bounded (module doc)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, limits: RenderLimits | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits or RenderLimits()
        self.finalize = self._finalize
        self.globals["range"] = self._range
        self.globals["lipsum"] = _lipsum
        self.filters = {n: self.bounded_filter(n, f) for n, f in self.filters.items()}

    # -- compile ----------------------------------------------------------------------

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        if len(source) > self.limits.max_source_chars:
            raise TemplateLimitError(
                f"the template has {len(source):,} characters; "
                f"the limit is {self.limits.max_source_chars:,}"
            )
        return _GuardLoopsAndConcat().visit(super()._parse(source, name, filename))

    # -- run time: loops, joins, calls, operators -------------------------------------

    def guard_loop(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Every `for` loop iterates through here: iterations are counted for the render."""
        budget = _BUDGET.get()
        for item in iterable:
            if budget is not None:
                budget.step()
            yield item

    def concat_values(self, *parts: Any) -> str:
        """`a ~ b ~ c`, sized before the string is built."""
        limit = self.limits.max_chars
        if sum(text_size(p, limit) for p in parts) > limit:
            raise TemplateLimitError(f"a ~ concatenation would be over {limit:,} characters")
        return self._checked("".join(str(p) for p in parts), "a ~ concatenation")

    def concat(self, parts: list[str]) -> str:  # type: ignore[override]
        """Joins a macro's or a `{% set %}` block's output (Jinja's `environment.concat`)."""
        self._size_at_most(sum(len(p) for p in parts), "a block's output")
        return self._checked("".join(parts), "a block's output")

    def _range(self, *args: int) -> range:
        result = range(*args)
        if len(result) > self.limits.max_range:
            raise TemplateLimitError(
                f"range() of {len(result):,} elements; the limit is {self.limits.max_range:,}"
            )
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        # `__self`, as in Jinja: a template may pass a keyword argument named `self`
        _tick()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's `loop(children)`
            args = (__self.guard_loop(args[0]), *args[1:])
        try:
            args = __self._check_method(__obj, args, kwargs)
        except TooLarge as exc:
            raise TemplateLimitError(str(exc)) from None
        return __self._checked(super().call(__context, __obj, *args, **kwargs), "a call")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        try:
            self._check_binop(operator, left, right)
        except TooLarge as exc:
            raise TemplateLimitError(str(exc)) from None
        result = self.binop_table[operator](left, right)
        return self._checked(result, f"the {operator} operator")

    # -- filters and output -----------------------------------------------------------

    def bounded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` as the filter `name`, with its input and output sized (also for filters
        added after construction, such as transformers' `tojson`)."""
        offset = 1 if hasattr(func, "jinja_pass_arg") else 0
        try:
            signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):
            signature = None

        def bounded(*args: Any, **kwargs: Any) -> Any:
            _tick()
            try:
                args = self._check_filter(name, signature, offset, args, kwargs)
            except TooLarge as exc:
                raise TemplateLimitError(str(exc)) from None
            return self._checked(func(*args, **kwargs), f"the {name} filter")

        for attr in ("jinja_pass_arg", "__name__", "__doc__"):
            if hasattr(func, attr):
                setattr(bounded, attr, getattr(func, attr))
        return bounded

    def _finalize(self, value: Any) -> Any:
        """Every `{{ ... }}` value is sized before Jinja turns it into a string."""
        if isinstance(value, str):
            return value
        try:
            check_text_size(value, self.limits.max_chars, "an output value")
        except TooLarge as exc:
            raise TemplateLimitError(str(exc)) from None
        if (budget := _BUDGET.get()) is not None:  # str() of it is a new string
            budget.build(text_size(value, self.limits.max_chars))
        return value

    # -- checks -----------------------------------------------------------------------

    def _check_binop(self, operator: str, left: Any, right: Any) -> None:
        lim = self.limits
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(times, int) and isinstance(seq, str | list | tuple):
                    cap = lim.max_chars if isinstance(seq, str) else lim.max_items
                    if len(seq) * times > cap:
                        raise TooLarge(
                            f"repeating a {type(seq).__name__} of length {len(seq):,} "
                            f"{times:,} times exceeds the limit of {cap:,}"
                        )
            if isinstance(left, int) and isinstance(right, int):
                self._int_bits(left.bit_length() + right.bit_length(), "a product")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                self._int_bits(right * left.bit_length(), "a power")
        elif operator == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                cap = lim.max_chars if isinstance(left, str) else lim.max_items
                if len(left) + len(right) > cap:
                    raise TooLarge(f"a sum of length {len(left) + len(right):,} exceeds {cap:,}")
            elif isinstance(left, int) and isinstance(right, int):
                self._int_bits(max(left.bit_length(), right.bit_length()) + 1, "a sum")
        elif operator == "%" and isinstance(left, str):
            self._size_at_most(percent_size(left, right, lim.max_chars), "a % format")

    def _check_filter(
        self,
        name: str,
        signature: inspect.Signature | None,
        offset: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, ...]:
        """Size the filter's result before it runs; returns the arguments to call it with
        (a lazily mapped sequence given to `join` is listed first, to be measured)."""
        lim = self.limits
        if len(args) <= offset:
            return args
        value = args[offset]
        self._int_args([*args[offset + 1 :], *kwargs.values()])
        if isinstance(value, str) and name not in _TEXT_FILTERS and len(value) > lim.max_items:
            raise TooLarge(f"the {name} filter would split {len(value):,} characters")
        if name == "join" and not isinstance(value, str | list | tuple | dict):
            value = list(itertools.islice(value, lim.max_items + 1))
            if len(value) > lim.max_items:
                raise TooLarge(f"join of over {lim.max_items:,} items")
            args = (*args[:offset], value, *args[offset + 1 :])
        if name not in _NON_TEXT_FILTERS:
            check_text_size(value, lim.max_chars, f"the {name} filter's input")
        if name == "sum" or name in _MULTIPLYING_FILTERS:
            bound = _bind(signature, args, kwargs, offset)
            if name == "sum" and not isinstance(bound.get("start", 0), int | float):
                raise TooLarge("the sum filter adds numbers only, in a chat template")
            if name in _MULTIPLYING_FILTERS:
                size = _text_filter_size(name, bound, value, lim)
                self._size_at_most(size, f"the {name} filter")
        return args

    def _check_method(
        self, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, ...]:
        """Size a str method's result before calling it; other calls pass as they are."""
        target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if not isinstance(owner, str):
            return args
        self._int_args([*args, *kwargs.values()])
        lim = self.limits
        if name in ("format", "format_map"):
            size = format_size(owner, args, kwargs, lim.max_chars)
        elif name == "join" and args:
            items = list(itertools.islice(args[0], lim.max_items + 1))
            if len(items) > lim.max_items:
                raise TooLarge(f"join of over {lim.max_items:,} items")
            size = sum(text_size(i, lim.max_chars) for i in items) + len(owner) * len(items)
            args = (items, *args[1:])
        elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
            size = _replace_size(owner, args[0], args[1])
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            size = len(owner) + owner.count("\t") * (tab if isinstance(tab, int) else 8)
        elif name in ("split", "rsplit", "splitlines"):
            seps = [args[0]] if args and isinstance(args[0], str) else [" ", "\n", "\t"]
            count = sum(owner.count(s) for s in seps if s)
            if count > lim.max_items:
                raise TooLarge(f"{name} into {count:,} parts; the limit is {lim.max_items:,}")
            return args
        else:
            return args
        self._size_at_most(size, f"str.{name}")
        return args

    def _checked(self, value: Any, what: str) -> Any:
        """A result already built: checked, and counted against the render's total."""
        lim = self.limits
        if isinstance(value, str) and len(value) > lim.max_chars:
            raise TemplateLimitError(f"{what} returned {len(value):,} characters")
        if isinstance(value, list | tuple | dict) and len(value) > lim.max_items:
            raise TemplateLimitError(f"{what} returned {len(value):,} items")
        budget = _BUDGET.get()
        if budget is not None and isinstance(value, str | list | tuple | dict):
            budget.build(len(value))
        return value

    def _int_args(self, values: Iterable[Any]) -> None:
        cap = self.limits.max_int_arg
        for v in values:
            if isinstance(v, int) and abs(v) > cap:
                raise TooLarge(f"an argument of {v:,} is above the limit of {cap:,}")

    def _int_bits(self, bits: int, what: str) -> None:
        if bits > self.limits.max_int_bits:
            raise TooLarge(
                f"{what} would have about {bits:,} bits; the limit is {self.limits.max_int_bits:,}"
            )

    def _size_at_most(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise TooLarge(
                f"{what} would be over {size:,} characters; the limit is {self.limits.max_chars:,}"
            )


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    """Jinja's `lipsum` global, bounded: unbounded, `lipsum(10**6)` runs for minutes."""
    if not (isinstance(n, int) and isinstance(max, int)) or n * max > 100_000:
        raise TemplateLimitError("lipsum() is limited to 100,000 words")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _tick() -> None:
    if (budget := _BUDGET.get()) is not None:
        budget.tick()


def _bind(
    signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any], offset: int
) -> dict[str, Any]:
    """The filter's arguments by name. Jinja's async-capable filters are wrappers that take
    an extra first argument their signature (the sync function's) does not list."""
    if signature is None:
        return {}
    for given in (args, args[offset:]):
        try:
            return dict(signature.bind(*given, **kwargs).arguments)
        except TypeError:
            continue
    return {}  # wrong arguments: the filter itself will say so


def _replace_size(text: str, old: str, new: str) -> int:
    count = len(text) + 1 if not old else text.count(old)
    return len(text) + count * max(len(new) - len(old), 0)


def _text_filter_size(name: str, bound: dict[str, Any], value: Any, lim: RenderLimits) -> int:
    """An upper bound on the output of a filter that can multiply its input."""
    text = value if isinstance(value, str) else ""
    size = text_size(value, lim.max_chars)
    if name == "join":
        count = len(value) if isinstance(value, list | tuple | str | dict) else 0
        return size + len(str(bound.get("d", ""))) * count
    if name == "replace":
        return _replace_size(str(value), str(bound.get("old", "")), str(bound.get("new", "")))
    if name == "indent":
        width = bound.get("width", 4)
        per_line = len(width) if isinstance(width, str) else int(width)
        return size + (text.count("\n") + 1) * per_line
    if name == "wordwrap":
        width = max(int(bound.get("width", 79)), 1)
        wrap = bound.get("wrapstring") or "\n"
        return size + (size // width + 1) * len(str(wrap))
    if name == "format":
        return percent_size(text, bound.get("args") or bound.get("kwargs") or (), lim.max_chars)
    if name == "tojson":
        indent = bound.get("indent")
        width = len(indent) if isinstance(indent, str) else int(indent or 0)
        if width > 16:
            raise TooLarge(f"a tojson indent of {width}; the limit is 16")
        return size * (2 + width)
    if name == "center":
        return max(size, int(bound.get("width", 80)))
    return size


class _GuardLoopsAndConcat(NodeTransformer):
    """Routes every `for` loop's iterable through `environment.guard_loop`, and every `~`
    through `environment.concat_values`, in one pass over the parsed template."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = _call_env("guard_loop", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return _call_env("concat_values", node.nodes, node.lineno)


def _call_env(method: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
    call = nodes.Call(nodes.EnvironmentAttribute(method), args, [], None, None)
    return call.set_lineno(lineno)


def render_bounded(
    template: jinja2.Template, limits: RenderLimits, variables: dict[str, Any]
) -> str:
    """Render with a fresh budget, streaming, and stop at the output limit."""
    budget = _Budget(limits)
    token = _BUDGET.set(budget)
    try:
        parts, total = [], 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            if total > limits.max_chars:
                raise TemplateLimitError(f"the output passed {limits.max_chars:,} characters")
            budget.tick()
            parts.append(chunk)
        return "".join(parts)
    finally:
        _BUDGET.reset(token)
