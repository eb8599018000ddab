"""Test helpers for compiled graphs (`ninfer_core.engine.compiled_step.CompiledGraph`)."""

from __future__ import annotations


def count_traced(fn) -> list[int]:
    """Counts `fn`'s calls that go through torch.compile rather than a direct call of
    the compiled code (one entry per call, appended as it happens)."""
    traced, calls = fn._traced, []

    def counted(*args):
        calls.append(1)
        return traced(*args)

    fn._traced = counted
    return calls
