"""PNG plots of `ninfer bench serve`: TTFT, prefill tok/s and decode tok/s against context
length, one line per scenario × concurrency (a second endpoint dashed, in the same colours).

matplotlib is the optional `plot` extra: serving never needs it, and the bench asks for it
before the first request (`require_matplotlib`), not after an hour of measuring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from ninfer_core.bench.serve_workload import context_label
from ninfer_core.extras import require

#: metric → (file stem, axis label, log scale on y).
METRICS = {
    "ttft_ms": ("ttft", "TTFT (ms, median)", True),
    "prefill_tok_s": ("prefill", "prefill tok/s (median)", False),
    "decode_tok_s": ("decode", "decode tok/s per stream (median)", False),
}
#: matplotlib's tab10: distinct, and exact RGB values a test can look for in the image.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip
SIZE_IN, DPI = (8.0, 5.0), 100


class Line(NamedTuple):
    """One line of a plot: its legend label, colour, whether dashed, and its points."""

    label: str
    color: str
    dashed: bool
    xs: list[int]
    ys: list[float]


def require_matplotlib() -> Any:
    return require("matplotlib", "plot", needed_by="ninfer bench serve's PNG plots")


def lines(result: dict[str, Any], metric: str) -> list[Line]:
    """The lines of `metric`'s plot, points sorted by context length."""
    combos = sorted({(c["scenario"], c["concurrency"]) for c in result["cells"]})
    compare = len(result["endpoints"]) > 1
    out = []
    for e in result["endpoints"]:
        for i, (scenario, conc) in enumerate(combos):
            points = sorted(
                (c["context"], c[metric]["median"])
                for c in result["cells"]
                if c["endpoint"] == e["label"] and c["scenario"] == scenario
                and c["concurrency"] == conc and c.get(metric)
            )  # fmt: skip
            if not points:
                continue
            label = f"{scenario} C{conc}" + (f" ({e['label']}: {e['model']})" if compare else "")
            out.append(Line(label, COLORS[i % len(COLORS)], e["label"] != "A",
                            [p[0] for p in points], [p[1] for p in points]))  # fmt: skip
    return out


def plot_metric(result: dict[str, Any], metric: str, path: Path) -> list[Line]:
    """One PNG (800×500) of `metric` against context length; the lines drawn."""
    mpl = require_matplotlib()
    mpl.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    _, ylabel, log_y = METRICS[metric]
    drawn = lines(result, metric)
    fig, ax = plt.subplots(figsize=SIZE_IN, dpi=DPI)
    try:
        for line in drawn:
            ax.plot(line.xs, line.ys, color=line.color, linestyle="--" if line.dashed else "-",
                    marker="o", linewidth=2, label=line.label)  # fmt: skip
        contexts = sorted({c["context"] for c in result["cells"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [context_label(c) for c in contexts])
        ax.xaxis.set_minor_locator(NullLocator())
        if log_y:
            ax.set_yscale("log")
            # 4×10² reads worse than 400
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        models = ", ".join(f"{e['label']}: {e['model']}" for e in result["endpoints"])
        ax.set_title(f"{ylabel.split(' (')[0]}, {result['max_tokens']} new tokens ({models})",
                     fontsize=10)  # fmt: skip
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return drawn


def plot_all(result: dict[str, Any], out: Path) -> list[Path]:
    """`ttft.png`, `prefill.png` and `decode.png` in `out`."""
    paths = []
    for metric, (stem, _, _) in METRICS.items():
        path = out / f"{stem}.png"
        plot_metric(result, metric, path)
        paths.append(path)
    return paths
