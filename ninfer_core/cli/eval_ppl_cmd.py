"""`ninfer eval-ppl MODEL FILE`: the model's perplexity on a text file."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ninfer_core.cli.args import add_config_arguments, config_from_args
from ninfer_core.config import RuntimeConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-ppl", help="perplexity of a model on a text file")
    p.add_argument("model", help="model folder or .ninfer file")
    p.add_argument("file", help="UTF-8 text; special tokens written in it are read as such")
    p.add_argument("--context", type=int, default=512, help="tokens per scored window")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_config_arguments(p, RuntimeConfig, skip=("device_spec", "kv_dtype", "block_size"))
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ninfer_core.eval_ppl import eval_ppl_file

    runtime = config_from_args(RuntimeConfig, ns)
    if runtime.threads > 0:
        torch.set_num_threads(runtime.threads)
    result = eval_ppl_file(
        ns.model, ns.file, context=ns.context, max_tokens=ns.max_tokens, runtime=runtime
    )
    if ns.json:
        fields = {"tokens": result.tokens, "windows": result.windows, "context": result.context}
        fields |= {"nll": result.nll, "perplexity": result.perplexity}
        json.dump(fields, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(
            f"perplexity {result.perplexity:.3f} ({result.bits_per_token:.3f} bits/token) over "
            f"{result.tokens} tokens in {result.windows} windows of {result.context}"
        )
    return 0
