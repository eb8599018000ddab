"""`ninfer bench memory`: how the process's RSS moves as contexts grow, phase by phase.

Issue 13 found RSS that only grew: every decode step at a context length the process had
not seen before compiled and cached a new oneDNN matmul kernel (about 1.3 MiB each), so
one 1,500-token generation took the built-in model from 0.31 to 1.23 GB. Decode attention
now pads its context to `decode_length` (a bounded set of shapes); this bench shows what is
left, against the memory plan's `runtime` term, in phases:

1. load the model and build the engine; one short warm-up request;
2. one long generation (every context from the prompt to `--new` tokens, unseen);
3. a fresh prompt decoded at `--unseen-steps` further unseen lengths;
4. the same lengths again (nothing new should be built);
5. prompts of many distinct lengths (new prefill shapes), two tokens each.

The KV pool is zeroed by `calloc`, so its pages count in RSS only once written: part of
each phase's growth is the pool filling up, which the plan already counts.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from typing import Any

from ninfer_core.bench import kernel_ops_line
from ninfer_core.config import opt

MIB = 1 << 20


@dataclass
class MemoryBenchConfig:
    """Phase sizes for `ninfer bench memory`."""

    new: int = opt(1500, "tokens of the one long generation (phase 2)")
    unseen_steps: int = opt(200, "decode steps at unseen lengths, then again (phases 3, 4)")
    prefills: int = opt(50, "prompts of distinct lengths (phase 5)")
    dtype: str = opt("bf16", "compute dtype (bf16, fp32)")
    threads: int = opt(1, "torch threads (RSS does not depend on them; 1 keeps a busy box usable)")
    malloc_trim: bool = opt(False, "call glibc malloc_trim(0) after each phase")
    as_json: bool = opt(False, "print the figures as JSON", flag="--json")


def rss_bytes() -> int:
    """Resident set size of this process now (`/proc/self/statm`)."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's peak RSS so far (`VmHWM`)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def malloc_trim() -> bool:
    """Give glibc's free heap pages back to the kernel; False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    """Ids that share no prefix across salts, so the prefix cache reuses nothing."""
    return [(salt * 7919 + i * 104729) % (vocab - 20) + 10 for i in range(n)]


def run_phases(loaded: Any, host: Any, device: Any, cfg: MemoryBenchConfig) -> dict[str, Any]:
    """Run the phases on `loaded`; RSS after each, and the plan's runtime term."""
    from ninfer_core.engine.config import EngineConfig
    from ninfer_core.engine.engine import Engine
    from ninfer_core.engine.request import GenerationRequest
    from ninfer_core.memory.planner import cpu_runtime_bytes
    from ninfer_core.sampling import SamplingParams

    longest = 16 + cfg.new + cfg.unseen_steps + 16
    max_context = min(loaded.config.max_position_embeddings, max(longest, 64))
    config = EngineConfig(max_context=max_context, max_concurrency=1, prefix_cache=False)
    engine = Engine(loaded, config, host=host, device=device)
    vocab = loaded.config.vocab_size
    phases: list[dict[str, Any]] = []

    def record(name: str, started: float) -> None:
        if cfg.malloc_trim:
            malloc_trim()
        rss = rss_bytes()
        growth = rss - phases[-1]["rss"] if phases else 0
        seconds = time.perf_counter() - started
        phases.append({"phase": name, "rss": rss, "growth": growth, "seconds": seconds})

    def generate(prompt: list[int], new: int) -> None:
        params = SamplingParams(temperature=0.0)
        engine.generate([GenerationRequest(prompt, params, max_tokens=new, ignore_eos=True)])

    t = time.perf_counter()
    generate(_prompt(16, 0, vocab), 4)
    record("loaded, warm-up request", t)
    t = time.perf_counter()
    generate(_prompt(16, 1, vocab), min(cfg.new, max_context - 16))
    record(f"one {cfg.new}-token generation", t)
    start = min(16 + cfg.new, max_context - cfg.unseen_steps)
    unseen = _prompt(start, 2, vocab)
    for label in (f"{cfg.unseen_steps} decode steps at unseen lengths", "the same lengths again"):
        t = time.perf_counter()
        generate(unseen, cfg.unseen_steps)
        record(label, t)
    t = time.perf_counter()
    for j in range(cfg.prefills):
        generate(_prompt(32 + j * (start - 32) // max(cfg.prefills, 1), 3 + j, vocab), 2)
    record(f"{cfg.prefills} prompts of distinct lengths", t)
    engine.close()
    return {
        "model": str(loaded.path),
        "dtype": cfg.dtype,
        "kernel_ops": [c.to_json() for c in loaded.kernels],
        "max_context": max_context,
        "phases": phases,
        "growth_after_warmup": phases[-1]["rss"] - phases[0]["rss"],
        "peak_rss": peak_rss_bytes(),
        "kv_pool_bytes": engine.runner.kv_store.nbytes,
        "planned_runtime_bytes": cpu_runtime_bytes(),
    }


def render(result: dict[str, Any]) -> str:
    """The phases as a Markdown table, then the plan's runtime term for comparison."""
    lines = [
        f"model {result['model']} ({result['dtype']}), max context {result['max_context']}",
        kernel_ops_line(result["kernel_ops"]),
        "| phase | RSS MiB | growth MiB | seconds |",
        "| --- | --- | --- | --- |",
    ]
    for p in result["phases"]:
        lines.append(
            f"| {p['phase']} | {p['rss'] / MIB:.1f} | {p['growth'] / MIB:+.1f} | "
            f"{p['seconds']:.1f} |"
        )
    lines.append(
        f"growth after warm-up {result['growth_after_warmup'] / MIB:+.1f} MiB; peak RSS "
        f"{result['peak_rss'] / MIB:.1f} MiB; KV pool {result['kv_pool_bytes'] / MIB:.1f} MiB "
        f"(filled as written); the plan's CPU runtime term "
        f"{result['planned_runtime_bytes'] / MIB:.1f} MiB"
    )
    return "\n".join(lines)
