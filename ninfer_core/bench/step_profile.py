"""Where a decode step's time goes: ms per step by op kind, measured in the engine itself.

`StepProfiler` wraps, for the duration of a `with` block, the kernel ops the model calls
(`linear` by the weight it multiplies, `rms_norm`, `apply_rope`, `silu_and_mul`,
`paged_attention` with the KV store's `write` and gathers inside it, the per-step
`prepare`), the runner's metadata build, the head's logits and the sampler, and times
each `Engine.step`. Times are exclusive (a call's time less that of the wrapped calls
inside it), so the parts add up to the step; what no wrapper covers (the layer loop's
own Python, residual adds, reshapes, the embedding lookup, scheduling and the text
step) is the remainder, "python, dispatch and the rest".

On the CPU every op runs synchronously, so wall time around a call is the op's time.
The wrappers add about a microsecond a call: a few hundred calls a step cost well under
a millisecond, which lands in the remainder.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: Parts in the order the breakdown prints them (those never seen are left out).
#: The compiled decode step (`engine/compiled_step.py`), timed whole: every layer's ops,
#: the head and the K/V store.
COMPILED = "compiled step (every layer, head, KV store)"
ORDER = (
    COMPILED,
    "linear",
    "attention: kv write",
    "attention: kv gather",
    "attention: compute",
    "attention: per-step plan",
    "rms_norm",
    "rope",
    "activation (silu*mul)",
    "logits (head output to fp32)",
    "sampling",
    "metadata (host)",
)
REST = "python, dispatch and the rest"


@dataclass
class StepBreakdown:
    """Mean ms per decode step, split by part; `linears` splits the linear time by weight."""

    steps: int
    step_ms: float
    parts: dict[str, float] = field(default_factory=dict)
    linears: dict[str, float] = field(default_factory=dict)
    #: Calls per step of each part (kernel launches, on the CPU: dispatches).
    calls: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "step_ms": self.step_ms,
            "parts_ms": self.parts,
            "linear_ms_by_weight": self.linears,
            "calls_per_step": self.calls,
        }

    def render(self) -> str:
        lines = [f"decode step: {self.step_ms:.2f} ms (mean of {self.steps} steps)"]
        for name, ms in self.parts.items():
            share = 100 * ms / self.step_ms if self.step_ms else 0.0
            calls = self.calls.get(name)
            n = f"  {calls:5.0f} calls" if calls else ""
            lines.append(f"  {name:<32} {ms:7.2f} ms {share:5.1f}%{n}")
            if name == "linear":
                for weight, wms in self.linears.items():
                    lines.append(f"    {weight:<30} {wms:7.2f} ms")
        return "\n".join(lines)


def _weight_names(model: torch.nn.Module) -> dict[int, str]:
    """id(weight) -> the attribute name it has in the model (`qkv_proj`, `o_proj`, ...),
    for parameters and for what a backend packed them into alike."""
    names: dict[int, str] = {}
    for module in model.modules():
        for attr, value in (*module._parameters.items(), *vars(module).items()):
            if value is not None and not attr.startswith("_"):
                names.setdefault(id(value), attr)
    return names


class StepProfiler:
    """Instruments an `Engine` while active; `breakdown()` summarises the steps seen."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._saved: list[tuple[object, str, bool, Any]] = []
        self._total: dict[str, float] = defaultdict(float)
        self._linear: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)
        self._inner: list[float] = []  # time of wrapped calls inside the current call
        self._steps: list[float] = []

    def _wrap(self, obj: object, attr: str, part: Callable[..., str] | str) -> None:
        original = getattr(obj, attr, None)
        if original is None:
            return
        own = attr in vars(obj)
        self._saved.append((obj, attr, own, vars(obj).get(attr)))

        def timed(*args, **kwargs):
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed
                name = part(*args) if callable(part) else part
                self._total[name] += elapsed - inner
                self._calls[name] += 1
                if name == "linear":
                    self._linear[self._names.get(id(args[1]), "other")] += elapsed - inner

        setattr(obj, attr, timed)

    def __enter__(self) -> StepProfiler:
        engine = self.engine
        runner = engine.runner
        model, ops, store = runner.model, runner.model.ops, runner.kv_store
        self._names = _weight_names(model)
        compiled = runner.compiled
        if compiled is not None and compiled.failed is None:
            # Its ops were traced into the graph: wrapping them now would change what the
            # graph was compiled against. The step is timed whole.
            self._wrap(compiled, "run", COMPILED)
        else:
            self._wrap_ops(ops, store, model)
        self._wrap(engine.postprocess.sampler, "sample", "sampling")
        self._wrap(runner, "prepare", "metadata (host)")
        original_step = engine.step

        def step(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original_step(*args, **kwargs)
            finally:
                self._steps.append(time.perf_counter() - start)

        self._saved.append((engine, "step", "step" in vars(engine), vars(engine).get("step")))
        engine.step = step
        return self

    def _wrap_ops(self, ops: Any, store: Any, model: torch.nn.Module) -> None:
        self._wrap(ops, "linear", "linear")
        self._wrap(ops, "rms_norm", "rms_norm")
        self._wrap(ops, "apply_rope", "rope")
        self._wrap(ops, "silu_and_mul", "activation (silu*mul)")
        self._wrap(ops, "paged_attention", "attention: compute")
        self._wrap(ops, "prepare", "attention: per-step plan")
        self._wrap(store, "write", "attention: kv write")
        self._wrap(store, "gather_heads", "attention: kv gather")
        self._wrap(store, "gather", "attention: kv gather")
        self._wrap(model, "compute_logits", "logits (head output to fp32)")

    def __exit__(self, *exc: object) -> None:
        for obj, attr, own, value in reversed(self._saved):
            if own:
                setattr(obj, attr, value)
            else:
                delattr(obj, attr)
        self._saved.clear()

    def reset(self) -> None:
        """Forget what was measured so far (the prefill step, a warm-up)."""
        self._total.clear()
        self._linear.clear()
        self._calls.clear()
        self._steps.clear()

    def breakdown(self) -> StepBreakdown:
        steps = len(self._steps)
        if not steps:
            return StepBreakdown(0, 0.0)
        step_ms = 1e3 * sum(self._steps) / steps
        parts = {n: 1e3 * self._total[n] / steps for n in ORDER if n in self._total}
        parts[REST] = max(0.0, step_ms - sum(parts.values()))
        linears = {
            n: 1e3 * t / steps for n, t in sorted(self._linear.items(), key=lambda kv: -kv[1])
        }
        calls = {n: self._calls[n] / steps for n in parts if n in self._calls}
        return StepBreakdown(steps, step_ms, parts, linears, calls)


def profile_decode(engine: Any, prompt: list[int], new: int) -> StepBreakdown:
    """The breakdown of the decode steps of one greedy request of `prompt` for `new`
    tokens through `engine` (its prefill step left out)."""
    from ninfer_core.bench.greedy import greedy_request
    from ninfer_core.generation import GenerationStats, stream

    request = greedy_request(prompt, new)
    stats = GenerationStats()
    with StepProfiler(engine) as profiler:
        prefilled = False
        for _ in stream(engine, request, stats):
            if not prefilled and stats.token_ids:
                profiler.reset()
                prefilled = True
        return profiler.breakdown()
