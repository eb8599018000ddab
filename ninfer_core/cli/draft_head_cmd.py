"""`ninfer draft-head build MODEL --corpus DIR --rows N`: a copy of MODEL with a reduced
draft head for `--lm-head-draft` (`ninfer_core/draft_head_build.py`): a `.ninfer` file for
a `.ninfer` or GGUF input, a model folder for a model folder."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

import torch

from ninfer_core.cli.args import add_config_arguments, config_from_args
from ninfer_core.config import RuntimeConfig
from ninfer_core.draft_head_build import CORPUS_SUFFIXES, DEFAULT_CONTEXT, DEFAULT_HELDOUT

if TYPE_CHECKING:
    from ninfer_core.draft_head_build import DraftHeadReport, SplitCounts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "draft-head",
        help="reduced heads for drafting (--lm-head-draft)",
        description="A reduced head holds the rows of the tokens the target produces most; "
        "`--spec mtp --lm-head-draft` drafts with it (verification keeps the full head).",
    )
    actions = p.add_subparsers(dest="draft_head_action", required=True, metavar="ACTION")
    b = actions.add_parser(
        "build",
        help="rank tokens over a corpus and write MODEL with a draft head",
        description="Runs the target over the corpus, counts its argmax token at every "
        "position, keeps the N most frequent (special and stop tokens always) and writes a "
        "copy of MODEL with them: a .ninfer file (MODEL's objects unchanged plus the "
        "`draft_head` component; a GGUF file is converted as `ninfer convert` does), or, for a "
        "model folder, a new folder with MODEL's files and draft_head.safetensors.",
    )
    b.add_argument(
        "model",
        metavar="MODEL",
        help="a .ninfer file (version 3), a GGUF file or a Hugging Face model folder",
    )
    b.add_argument(
        "--corpus",
        required=True,
        metavar="DIR",
        help=f"folder of text files ({', '.join(CORPUS_SUFFIXES)}; any depth)",
    )
    b.add_argument("--rows", type=int, required=True, metavar="N", help="tokens to keep")
    b.add_argument(
        "--out",
        metavar="OUT",
        help="what to write (default: beside MODEL, MODEL.draft-head.ninfer for a file, the "
        "folder MODEL.draft-head for a folder; a folder must not exist or be empty)",
    )
    b.add_argument(
        "--heldout-fraction",
        type=float,
        default=DEFAULT_HELDOUT,
        metavar="F",
        help="share of files (by a hash of their path) kept out of the ranking to measure "
        f"coverage on (default: {DEFAULT_HELDOUT})",
    )
    b.add_argument(
        "--context",
        type=int,
        default=DEFAULT_CONTEXT,
        metavar="T",
        help=f"tokens per window the target runs over (default: {DEFAULT_CONTEXT})",
    )
    b.add_argument(
        "--max-tokens",
        type=int,
        metavar="M",
        help="stop after M corpus tokens, every file's first window before any second "
        "(default: all, in path order)",
    )
    b.add_argument("--json", action="store_true", help="print the report as JSON")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_arguments(
        b, RuntimeConfig, skip=("device_spec", "kv_dtype", "block_size", "compile_decode")
    )
    b.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from ninfer_core.draft_head_build import build_draft_head

    runtime = config_from_args(RuntimeConfig, ns)
    if runtime.threads > 0:
        torch.set_num_threads(runtime.threads)
    bar = None
    if not (ns.no_progress or ns.json):
        from tqdm import tqdm

        bar = tqdm(total=ns.max_tokens, unit="token", file=sys.stderr, leave=False)
    try:
        report = build_draft_head(
            ns.model,
            ns.corpus,
            ns.rows,
            out=ns.out,
            heldout_fraction=ns.heldout_fraction,
            context=ns.context,
            max_tokens=ns.max_tokens,
            runtime=runtime,
            progress=None if bar is None else bar.update,
        )
    finally:
        if bar is not None:
            bar.close()
    if ns.json:
        json.dump(report_json(report), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(report))
    return 0


def _split_json(split: SplitCounts, token_ids: list[int]) -> dict[str, Any]:
    from ninfer_core.spec.draft_head import covered

    return {
        "files": split.files,
        "tokens": split.tokens,
        "distinct": split.distinct,
        "covered": covered(split.counts, token_ids),
        "coverage": split.coverage(token_ids),
    }


def report_json(report: DraftHeadReport) -> dict[str, Any]:
    """The report as plain JSON (`--json`); a coverage is null where no token was counted."""
    return {
        "path": str(report.path),
        "source": str(report.source),
        "rows": report.rows,
        "vocab": report.vocab,
        "special_ids": report.special_ids,
        "ranking": _split_json(report.ranking, report.token_ids),
        "heldout": _split_json(report.heldout, report.token_ids),
        "skipped": report.skipped,
        "seconds": {k: round(v, 3) for k, v in report.seconds.items()},
    }


def _coverage_line(name: str, split: SplitCounts, token_ids: list[int], note: str) -> str:
    share = split.coverage(token_ids)
    if share is None:
        return f"{name:<9} no tokens counted (no file in this set)"
    return (
        f"{name:<9} {100 * share:.2f}% of {split.tokens:,} argmax tokens "
        f"({split.distinct:,} distinct) in {split.files} files {note}"
    )


def render(report: DraftHeadReport) -> str:
    """One line each: rows, coverage (ranking set), held-out coverage, seconds, the file."""
    r, s = report, report.seconds
    lines = [
        f"rows      {r.rows} of {r.vocab} ({100 * r.rows / r.vocab:.1f}% of the vocabulary; "
        f"{len(r.special_ids)} special and stop tokens always kept)",
        _coverage_line("coverage", r.ranking, r.token_ids, "(ranking set)"),
        _coverage_line("held-out", r.heldout, r.token_ids, "(tokens a greedy target accepts)"),
        f"seconds   {s['total']:.1f} (convert {s['convert']:.1f}, load {s['load']:.1f}, "
        f"target over the corpus "
        f"{s['count']:.1f}, write {s['write']:.1f})",
    ]
    if r.skipped:
        more = ", ..." if len(r.skipped) > 5 else ""
        lines.append(
            f"skipped   {len(r.skipped)} files not UTF-8: {', '.join(r.skipped[:5])}{more}"
        )
    lines.append(f"wrote     {r.path}")
    return "\n".join(lines)
