"""Benchmarks: figures measured against a baseline in the same run, apart from the tests.

One module per benchmark, plus what they share. For `ninfer bench decode`: `checkpoint`
builds the benchmark model (Qwen3-0.6B shapes, random weights, the real Qwen vocabulary)
once and caches it, `bandwidth` measures memory bandwidth and turns it into a decode
ceiling, `decode` times ninfer against a peer (llama.cpp through `llama-cpp-python` on a
GGUF, transformers `generate` on a folder) and `step_profile` splits ninfer's decode step
by part. Nothing here is imported by the engine, and transformers and llama.cpp are
imported only when a benchmark runs them.

Every bench prints which kernel backend served each op (`kernel_ops_line`), from the
record the load made (`LoadedModel.kernels`, reported by `ninfer-serve`'s `/health`).
"""

from __future__ import annotations

from typing import Any


def kernel_ops_line(kernel_ops: list[dict[str, Any]] | None) -> str:
    """`kernel ops: ...` from `OpChoice.to_json` records, for a bench's header."""
    if not kernel_ops:
        return "kernel ops: not reported (a server that is not NInfer's?)"
    from ninfer_core.kernels.compose import OpChoice, kernel_line

    return kernel_line([OpChoice.from_json(d) for d in kernel_ops])
