"""`ninfer convert HF_DIR OUT.ninfer --recipe NAME`: quantize and pack a model folder."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="pack a Hugging Face model folder or a GGUF file into one .ninfer file "
        "(quantized by a recipe)",
        description="Reads one tensor at a time, encodes it by the recipe and writes a .ninfer "
        "container with the model's config, tokenizer, chat template and generation config.",
    )
    p.add_argument(
        "source",
        metavar="HF_DIR",
        help="Hugging Face model folder, or a GGUF file (its Q4_0/Q4_1/Q8_0 matrices keep "
        "their codes; --recipe bf16 dequantizes them)",
    )
    p.add_argument("out", metavar="OUT.ninfer", help="the file to write")
    p.add_argument(
        "--recipe",
        default="mixed",
        help="mixed (6-bit embeddings/head, 4-bit q/k/v and gate/up, 5-bit o/down), "
        "q4, q6, w8, bf16 (default: mixed)",
    )
    p.add_argument(
        "--container",
        default="v3",
        choices=["v1", "v2", "v3"],
        help="container version to write (older ones for compatibility; default: v3)",
    )
    p.add_argument("--model-id", help="identity model_id (v2+; default: the folder name)")
    p.add_argument(
        "--volume-mib",
        type=int,
        help="v3: split the payload into continuation volumes of at most this many MiB",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ninfer_core.convert import convert, summary_json, tqdm_progress
    from ninfer_core.errors import NInferError

    version = int(ns.container[1:])
    if ns.volume_mib is not None and (version < 3 or ns.volume_mib <= 0):
        raise NInferError("--volume-mib needs --container v3 and a positive size")
    summary = convert(
        ns.source,
        ns.out,
        recipe_name=ns.recipe,
        version=version,
        model_id=ns.model_id,
        volume_limit=ns.volume_mib * 2**20 if ns.volume_mib else None,
        progress=None if ns.no_progress or ns.json else tqdm_progress(),
    )
    sys.stdout.write((summary_json(summary) if ns.json else summary.render()) + "\n")
    return 0
