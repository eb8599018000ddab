"""`ninfer bench decode`: decode speed against transformers and the bandwidth ceiling.

A benchmark, not a test: it takes minutes and its figures depend on the machine. The
work is in `ninfer_core.bench`; this module parses options and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys

from ninfer_core.bench.decode import DecodeBenchConfig
from ninfer_core.cli.args import add_config_arguments, config_from_args
from ninfer_core.errors import NInferError

HEADER = (
    "dtype",
    "ninfer tok/s",
    "transformers tok/s",
    "ratio",
    "ceiling tok/s",
    "% of ceiling (ninfer / tf)",
    "prefill tok/s (ninfer / tf)",
    "greedy ids agree",
    "CPU share (ninfer / tf)",
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against a reference engine, in one run")
    benches = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    d = benches.add_parser(
        "decode",
        help="decode tok/s of ninfer and transformers generate, bf16 and fp32",
        description="Greedy decode tok/s of ninfer and transformers `generate` on the same "
        "checkpoint (default: Qwen3-0.6B shapes, random weights, the real Qwen vocabulary, "
        "built and cached on first use), with the memory-bandwidth ceiling.",
    )
    d.add_argument("model", nargs="?", help="model folder (default: the benchmark checkpoint)")
    add_config_arguments(d, DecodeBenchConfig)
    d.set_defaults(run=run)


def table(result: dict) -> str:
    """The figures as a Markdown table (what bench/README.md keeps)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    for r in result["rows"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        cells = (
            r["dtype"],
            f"{r['ninfer_decode_tok_s']:.1f}",
            f"{r['transformers_decode_tok_s']:.1f}",
            ratio,
            f"{r['ceiling_tok_s']:.1f}",
            f"{r['ninfer_pct_of_ceiling']:.0f}% / {r['transformers_pct_of_ceiling']:.0f}%",
            f"{r['ninfer_prefill_tok_s']:.0f} / {r['transformers_prefill_tok_s']:.0f}",
            f"{r['greedy_ids_agree']} of {r['new_tokens']}",
            f"{r['ninfer_cpu_share']:.2f} / {r['transformers_cpu_share']:.2f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(ns: argparse.Namespace) -> int:
    from ninfer_core.bench.decode import run_bench

    cfg = config_from_args(DecodeBenchConfig, ns)
    if cfg.new < 2 or cfg.prompt_tokens < 1 or cfg.repeats < 1:
        raise NInferError("--new must be at least 2, --prompt-tokens and --repeats at least 1")
    try:
        cfg.dtype_list()
    except ValueError as exc:
        raise NInferError(str(exc)) from None
    result = run_bench(cfg, ns.model)
    if cfg.as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"model: {result['model']}")
    print(
        f"threads: {result['threads']}, prompt {result['prompt_tokens']} tokens, "
        f"{result['new_tokens']} new, best of {result['repeats']}, "
        f"read bandwidth {result['read_gb_s']:.1f} GB/s"
    )
    for r in result["rows"]:
        print(
            f"{r['dtype']}: {r['weight_bytes_per_token'] / 1e9:.3f} GB weights + "
            f"{r['kv_bytes_per_token'] / 1e6:.1f} MB KV read per token"
        )
    print()
    print(table(result))
    shares = [r[k] for r in result["rows"] for k in ("ninfer_cpu_share", "transformers_cpu_share")]
    if min(shares) < 0.9:
        print(
            "\nwarning: a timed run got under 90% of its threads' CPU time; other processes "
            "were running and its figures are low. Rerun on a quiet machine."
        )
    return 0
