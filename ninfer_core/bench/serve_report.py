"""`ninfer bench serve`'s figures as the guide prints them: a Markdown table (also what the
terminal shows), the ratios against a second endpoint, the files under `--out`, and the
progress display.

A cell reads `median (min–max)` over every request of its runs; `wait` is observation 1
(see `serve`); `accept` and `tok/round` appear where the server reported speculation.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ninfer_core.bench import kernel_ops_line
from ninfer_core.bench.serve import Progress
from ninfer_core.bench.serve_workload import context_label

HEAD = ("scenario", "context", "C", "prompt tokens", "TTFT ms", "prefill tok/s",
        "decode tok/s", "accept", "tok/round", "wait", "errors")  # fmt: skip


def spread(s: dict[str, float] | None, fmt: str) -> str:
    """`median (min–max)`, or the median alone when there is no spread to show."""
    if not s:
        return "-"
    mid = format(s["median"], fmt)
    if s["n"] < 2 or format(s["min"], fmt) == format(s["max"], fmt):
        return mid
    return f"{mid} ({format(s['min'], fmt)}–{format(s['max'], fmt)})"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def rows(result: dict[str, Any], endpoint: str) -> list[tuple[str, ...]]:
    out = []
    for c in (c for c in result["cells"] if c["endpoint"] == endpoint):
        out.append((
            c["scenario"], context_label(c["context"]), str(c["concurrency"]),
            _num(c["prompt_tokens"], ".0f"), spread(c["ttft_ms"], ".0f"),
            spread(c["prefill_tok_s"], ".0f"), spread(c["decode_tok_s"], ".1f"),
            _num(c["acceptance"], ".2f"), _num(c["tokens_per_round"], ".2f"),
            spread(c["wait"], ".2f"), f"{c['errors']}/{c['requests']}",
        ))  # fmt: skip
    return out


def _md(head: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + [
        "| " + " | ".join(r) + " |" for r in body
    ]


def header(e: dict[str, Any]) -> str:
    return f"{e['label']}: {e['url']} ({e['api']}), model {e['model']}"


def markdown(result: dict[str, Any]) -> str:
    """The whole report: each endpoint's table, then the ratios B ÷ A."""
    lines = [
        f"{result['max_tokens']} generated tokens per request, {result['runs']} runs per cell; "
        "cells are median (min–max); wait = last TTFT ÷ the C1 prefills it queued behind.",
        "Prompt lengths counted by: "
        + ", ".join(sorted({s["counted_by"] for s in result["sizes"]})) + ".",
    ]  # fmt: skip
    for e in result["endpoints"]:
        lines += ["", header(e), kernel_ops_line(e["kernel_ops"]), ""]
        lines += _md(HEAD, rows(result, e["label"]))
    if result["compare"]:
        lines += ["", "B ÷ A (TTFT below 1: B answers sooner; tok/s above 1: B is faster)", ""]
        body = [
            (r["scenario"], context_label(r["context"]), str(r["concurrency"]),
             _num(r["ttft_ms"], ".2f"), _num(r["prefill_tok_s"], ".2f"),
             _num(r["decode_tok_s"], ".2f"))
            for r in result["compare"]
        ]  # fmt: skip
        lines += _md(("scenario", "context", "C", "TTFT", "prefill tok/s", "decode tok/s"), body)
    errors = [c for c in result["cells"] if c["first_error"]]
    for c in errors:
        lines.append(f"{c['endpoint']} {c['scenario']} {c['context']} C{c['concurrency']}: "
                     f"first error: {c['first_error']}")  # fmt: skip
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out: Path, plot: bool) -> list[Path]:
    """serve.json, serve.md and (with `plot`) the PNGs in `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    (out / "serve.md").write_text(markdown(result) + "\n")
    paths = [out / "serve.json", out / "serve.md"]
    if plot:
        from ninfer_core.bench.serve_plot import plot_all

        paths += plot_all(result, out)
    return paths


@contextmanager
def progress_display(total: int) -> Iterator[Progress]:
    """A `rich` progress bar on stderr while the bench runs (it can take an hour); one plain
    line per step where rich is missing or stderr is not a terminal."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    except ImportError:
        Console = None
    if Console is None or not sys.stderr.isatty():
        last = [""]

        def plain(done: int, what: str) -> None:
            if what != last[0]:
                print(f"bench serve: {what}", file=sys.stderr, flush=True)
                last[0] = what

        yield plain
        return
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("starting", total=total)

        def fancy(done: int, what: str) -> None:
            bar.update(task, advance=done, description=what)

        yield fancy
