"""`ninfer bench context`: prefill and decode tok/s against context length, a hybrid beside
a dense model of about its size, in one run.

A Gated DeltaNet layer keeps a fixed-size state per sequence, so a hybrid's decode step
reads a KV cache in only its few full-attention layers (one in four here), where every
layer of a dense model reads one as long as the context. The benchmark shows what that
buys on this machine: for each context length both models (`context_models`, random
weights, built here) prefill a prompt of that many tokens and decode `--new` more,
through the engine as `ninfer generate` runs a request (chunked prefill included). Each
model's decode tok/s is also given relative to its own at the shortest context (how flat
it stays), and the hybrid's figures relative to the dense model's at the same context.
The two models run alternately, context by context, so a busy machine disturbs both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ninfer_core.bench.context_models import MAX_POSITIONS, SIZES, ensure_models
from ninfer_core.bench.decode import DTYPES, WARMUP_TOKENS, CpuShare
from ninfer_core.bench.greedy import greedy_stats
from ninfer_core.config import opt
from ninfer_core.errors import NInferError
from ninfer_core.model.caches import ModelCaches, caches_for

MODELS = ("hybrid", "dense")


@dataclass
class ContextBenchConfig:
    """Context lengths, model size and decode length for `ninfer bench context`."""

    contexts: str = opt(
        "1024,2048,4096,8192,16384,32768", "comma-separated prompt lengths (tokens)"
    )
    size: Literal["tiny", "small", "medium"] = opt(
        "small", "model size (hidden / layers): tiny 64/4, small 256/8, medium 512/12"
    )
    new: int = opt(32, "tokens decoded after each prompt (greedy, eos ignored)")
    dtype: Literal["bf16", "fp32"] = opt("bf16", "compute dtype")
    kv_dtype: str = opt("auto", "KV cache codec (fp16, int8, rk8v4, ...); auto: the compute dtype")
    threads: int = opt(0, "torch threads; 0: one per available core")
    repeats: int = opt(1, "timed requests per point; each figure is the best of them")
    out: str | None = opt(None, "where the two random models are cached")
    compile_decode: bool = opt(
        False, "decode both models through the compiled step (`--compile-decode`)"
    )
    as_json: bool = opt(False, "print the figures as JSON", flag="--json")

    def context_list(self) -> list[int]:
        """The contexts, rising; a ValueError names a bad entry."""
        try:
            contexts = sorted({int(c) for c in self.contexts.split(",") if c.strip()})
        except ValueError:
            raise ValueError(f"--contexts {self.contexts!r}: expected integers") from None
        if not contexts or contexts[0] < 1:
            raise ValueError(f"--contexts {self.contexts!r}: expected positive lengths")
        return contexts

    def check(self) -> None:
        """Raise ValueError for settings no run can use (decode speed needs two tokens)."""
        longest = self.context_list()[-1]
        if longest + max(self.new, WARMUP_TOKENS) >= MAX_POSITIONS:
            raise ValueError(f"--contexts: {longest} + --new is past the models' {MAX_POSITIONS}")
        if self.new < 2 or self.repeats < 1:
            raise ValueError("--new must be at least 2 and --repeats at least 1")
        if self.size not in SIZES:
            raise ValueError(f"--size {self.size}: expected one of {', '.join(SIZES)}")


@dataclass
class _Model:
    """One model, loaded once, with an engine whose KV pool holds the longest context."""

    name: str
    path: Path
    loaded: Any
    engine: Any

    def generate(self, prompt: list[int], new: int) -> tuple[Any, float]:
        """One greedy request: (its `GenerationStats`, the CPU share it got)."""
        with CpuShare() as cpu:
            stats = greedy_stats(self.engine, prompt, new)
        return stats, cpu.share


def _open(
    name: str, path: Path, dtype: str, kv_dtype: str, context: int, compile_decode: bool
) -> _Model:
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.generation import one_request_engine
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    host, device = create_host(), probe_device()
    runtime = RuntimeConfig(
        dtype=dtype, kv_dtype=kv_dtype, max_context=context, compile_decode=compile_decode
    )
    loaded = load_model(path, host=host, device=device, runtime=runtime)
    engine = one_request_engine(loaded, host=host, device=device, runtime=runtime)
    return _Model(name, path, loaded, engine)


def describe(path: Path, dtype: str, caches: ModelCaches) -> dict[str, Any]:
    """Parameters (from the tensor headers), layers and what a token costs in cache:
    KV bytes per token (the paged layers, K and V at the compute dtype) and the fixed
    per-sequence state of the others. The caches are the ones the model's family declares
    (`model.caches.caches_for`, what the engine allocates), not worked out again here."""
    from ninfer_core.loading import opened_artifact
    from ninfer_core.model.weight_budget import held_weights

    with opened_artifact(path) as artifact:
        architecture, params = artifact.config["architectures"][0], held_weights(artifact)
    paged = caches.paged
    kv_width = 2 * paged[0].num_kv_heads * paged[0].head_dim if paged else 0
    return {
        "path": str(path),
        "architecture": architecture,
        "parameters": params,
        "layers": len(caches.layers),
        "full_attention_layers": len(paged),
        "kv_bytes_per_token": len(paged) * kv_width * DTYPES[dtype].itemsize,
        "state_bytes_per_sequence": caches.state_bytes_per_sequence,
    }


def run_bench(
    cfg: ContextBenchConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every figure of the benchmark, as plain data (the CLI prints or dumps it).
    `progress`, if given, gets a line after each point: a default run takes minutes."""
    from ninfer_core.bench.checkpoint import prompt_ids

    cfg.check()
    contexts = cfg.context_list()
    threads = cfg.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    paths = ensure_models(cfg.size, Path(cfg.out) if cfg.out else None)
    capacity = contexts[-1] + max(cfg.new, WARMUP_TOKENS) + 1  # the longest request fits
    load_before = os.getloadavg()
    models = [
        _open(name, paths[name], cfg.dtype, cfg.kv_dtype, capacity, cfg.compile_decode)
        for name in MODELS
    ]
    points: dict[str, list[dict[str, Any]]] = {name: [] for name in MODELS}
    try:
        prompt = prompt_ids(paths["hybrid"], contexts[-1])  # one tokenizer for both
        for model in models:  # also compiles the decode step, with --compile-decode
            model.generate(prompt[: min(64, len(prompt))], WARMUP_TOKENS)
        for context in contexts:
            for model in models:  # alternately, so both see the same machine
                point = _point(model, prompt[:context], cfg)
                points[model.name].append(point)
                if progress is not None:
                    progress(
                        f"{model.name} at {context}: prefill {point['prefill_tok_s']:.0f} "
                        f"tok/s, decode {point['decode_tok_s']:.1f} tok/s"
                    )
        loaded = {
            m.name: {"family": m.loaded.family.name,
                     "kernel_ops": [c.to_json() for c in m.loaded.kernels]}
            for m in models
        }  # fmt: skip
        caches = {m.name: caches_for(m.loaded.family, m.loaded.config) for m in models}
    finally:
        for model in models:
            model.engine.close()
    return {
        "size": cfg.size,
        "dtype": cfg.dtype,
        "kv_dtype": models[0].engine.kv_codec,
        "threads": threads,
        "new_tokens": cfg.new,
        "repeats": cfg.repeats,
        "compile_decode": cfg.compile_decode,
        "load_average": [load_before, os.getloadavg()],
        "torch": torch.__version__,
        "models": {
            name: describe(paths[name], cfg.dtype, caches[name]) | loaded[name] for name in MODELS
        },
        "rows": _rows(contexts, points),
    }


def _point(model: _Model, prompt: list[int], cfg: ContextBenchConfig) -> dict[str, Any]:
    """The best of `cfg.repeats` requests of `prompt` then `cfg.new` tokens."""
    runs = [model.generate(prompt, cfg.new) for _ in range(cfg.repeats)]
    if any(stats.completion_tokens != cfg.new for stats, _ in runs):
        got = [stats.completion_tokens for stats, _ in runs]
        raise NInferError(f"{model.name}: produced {got} tokens, not {cfg.new}")
    return {
        "prefill_tok_s": max(stats.prefill_tok_s for stats, _ in runs),
        "decode_tok_s": max(stats.decode_tok_s for stats, _ in runs),
        "tokens": runs[0][0].completion_tokens,
        "cpu_share": min(share for _, share in runs),
    }


def _rows(contexts: list[int], points: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per context: each model's point, its decode against its own at the
    shortest context, and the hybrid's prefill and decode against the dense model's."""
    rows = []
    for i, context in enumerate(contexts):
        row: dict[str, Any] = {"context": context}
        for name in MODELS:
            point, first = points[name][i], points[name][0]
            row[name] = point | {"decode_vs_shortest": _ratio(point, first, "decode_tok_s")}
        row["prefill_ratio"] = _ratio(row["hybrid"], row["dense"], "prefill_tok_s")
        row["decode_ratio"] = _ratio(row["hybrid"], row["dense"], "decode_tok_s")
        rows.append(row)
    return rows


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return a[key] / b[key] if b[key] else None


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(result: dict[str, Any]) -> str:
    """The figures as one Markdown table, a row per context."""
    shortest = result["rows"][0]["context"] if result["rows"] else 0
    header = (
        "context", "hybrid prefill tok/s", "dense prefill tok/s", "prefill hybrid/dense",
        "hybrid decode tok/s", f"hybrid vs {shortest}", "dense decode tok/s",
        f"dense vs {shortest}", "decode hybrid/dense",
    )  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in result["rows"]:
        h, d = r["hybrid"], r["dense"]
        cells = (
            str(r["context"]),
            f"{h['prefill_tok_s']:.0f}",
            f"{d['prefill_tok_s']:.0f}",
            _cell(r["prefill_ratio"], ".2f"),
            f"{h['decode_tok_s']:.1f}",
            _cell(h["decode_vs_shortest"], ".2f"),
            f"{d['decode_tok_s']:.1f}",
            _cell(d["decode_vs_shortest"], ".2f"),
            _cell(r["decode_ratio"], ".2f"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(result: dict[str, Any]) -> str:
    """The models, the table and a warning when the run did not get its threads."""
    from ninfer_core.bench import kernel_ops_line

    load = result["load_average"]
    lines = [
        f"size {result['size']}, {result['dtype']}, KV {result.get('kv_dtype', 'as compute')}, "
        f"{result['threads']} threads, "
        f"{result['new_tokens']} tokens decoded after each prompt, best of "
        f"{result['repeats']}"
        + ("; decode compiled (--compile-decode)" if result.get("compile_decode") else "")
        + f"; load average (1 min) {load[0][0]:.2f} before, "
        f"{load[1][0]:.2f} after (on {os.cpu_count()} CPUs)"
    ]
    for name, m in result["models"].items():
        state = m["state_bytes_per_sequence"]
        lines.append(
            f"{name}: {m['architecture']} (family {m['family']}), "
            f"{m['parameters'] / 1e6:.2f}M parameters, "
            f"{m['layers']} layers ({m['full_attention_layers']} full attention): "
            f"{m['kv_bytes_per_token'] / 1024:.1f} KiB KV a token"
            + (f" + {state / 2**20:.2f} MiB of state a sequence" if state else "")
            + f"; {kernel_ops_line(m['kernel_ops'])}; {m['path']}"
        )
    lines += ["", table(result)]
    low = [
        f"{name} at {r['context']} ({r[name]['cpu_share']:.2f})"
        for r in result["rows"]
        for name in MODELS
        if r[name]["cpu_share"] < 0.9
    ]
    if low:
        lines += [
            "",
            f"warning: some requests got under 90% of their threads' CPU time "
            f"({', '.join(low)}); other processes were running and those figures are "
            "low. Rerun on a quiet machine.",
        ]
    return "\n".join(lines)
