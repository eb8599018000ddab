"""`ninfer bench artifact`: load time, peak RSS and decode tok/s per `.ninfer` recipe.

The baseline is the Hugging Face folder the files are converted from, measured in the
same run: its load time and peak RSS (what mmap-ing a `.ninfer` saves), and the bf16
decode tok/s (what each recipe's fewer bytes per token buy). Each load is timed in a
fresh child process, so peak RSS is that load's alone and nothing is cached in this
process; decode runs one model at a time here, like `ninfer bench decode`.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ninfer_core.bench import kernel_ops_line
from ninfer_core.bench.decode import TimedRunConfig
from ninfer_core.config import opt


@dataclass
class ArtifactBenchConfig(TimedRunConfig):
    """Artifact benchmark: each recipe's .ninfer against the HF folder it came from."""

    recipes: str = opt("bf16,w8,q6,mixed,q4", "comma-separated recipes to convert and run")
    container: int = opt(3, "container version written for the benchmark files")
    skip_decode: bool = opt(False, "measure loading only")

    def recipe_list(self) -> list[str]:
        from ninfer_core.quant.recipes import recipe

        names = [r.strip() for r in self.recipes.split(",") if r.strip()]
        for name in names:
            recipe(name)  # an unknown name fails here, listing the known ones
        return names


def peak_rss_bytes() -> int:
    """This process's peak resident set since it last exec'd.

    Linux keeps `ru_maxrss` across `execve`, so a child forked from a process that
    had already grown reports the parent's peak; `VmHWM` belongs to the new address
    space and starts from zero. Where there is no /proc, `ru_maxrss` (KiB on Linux,
    bytes on macOS) is the best there is.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def measure_load(path: Path, threads: int) -> dict:
    """Load `path` (bf16 compute) in a child process: seconds, peak RSS, weight bytes."""
    code = (
        "import json, sys, time, torch\n"
        "torch.set_num_threads(int(sys.argv[2]))\n"
        "from ninfer_core.bench.artifact import peak_rss_bytes\n"
        "from ninfer_core.config import RuntimeConfig\n"
        "from ninfer_core.device import probe_device\n"
        "from ninfer_core.loading import load_model\n"
        "from ninfer_core.plugin_host import create_host\n"
        "start = time.perf_counter()\n"
        "m = load_model(sys.argv[1], host=create_host(), device=probe_device(),\n"
        "               runtime=RuntimeConfig(dtype='bf16'))\n"
        "seconds = time.perf_counter() - start\n"
        "print(json.dumps({'load_s': seconds, 'peak_rss': peak_rss_bytes(),\n"
        "                  'weight_bytes': m.model.weight_bytes(),\n"
        "                  'kernel_ops': [c.to_json() for c in m.kernels]}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), str(threads)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"loading {path} failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ensure_ninfer(source: Path, recipe_name: str, version: int) -> Path:
    """The benchmark checkpoint converted by `recipe_name`, cached beside it."""
    from ninfer_core.convert import convert

    out = source.parent / f"{source.name}-{recipe_name}-v{version}.ninfer"
    if not out.exists() or out.stat().st_mtime < (source / "config.json").stat().st_mtime:
        convert(source, out, recipe_name=recipe_name, version=version)
    return out


def run_bench(cfg: ArtifactBenchConfig, model: str | None = None) -> dict:
    """Every figure of the benchmark, as plain data (the CLI prints or dumps it)."""
    from ninfer_core.bench.checkpoint import ensure_checkpoint, prompt_ids
    from ninfer_core.bench.decode import run_ninfer

    recipes = cfg.recipe_list()
    threads = cfg.thread_count()
    torch.set_num_threads(threads)
    source = Path(model) if model else ensure_checkpoint(Path(cfg.out) if cfg.out else None)
    files = {name: ensure_ninfer(source, name, cfg.container) for name in recipes}
    prompt = prompt_ids(source, cfg.prompt_tokens)

    rows = []
    for label, path in [("hf-folder", source), *files.items()]:
        row = {"source": label, "path": str(path), **measure_load(path, threads)}
        row["file_bytes"] = (
            sum(f.stat().st_size for f in path.glob("*.safetensors"))
            if path.is_dir()
            else sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))
        )
        if not cfg.skip_decode:
            run = run_ninfer(path, "bf16", prompt, cfg.new, cfg.repeats)
            row["decode_tok_s"], row["prefill_tok_s"] = run.decode_tok_s, run.prefill_tok_s
            row["cpu_share"] = run.cpu_share
            gc.collect()
        rows.append(row)
    add_ratios(rows)
    return {
        "model": str(source),
        "threads": threads,
        "prompt_tokens": len(prompt),
        "new_tokens": cfg.new,
        "repeats": cfg.repeats,
        "rows": rows,
    }


def add_ratios(rows: list[dict]) -> None:
    """Each row's figures over its baseline's, measured in the same run.

    Load time and peak RSS are against the HF folder (the first row): what `.ninfer`
    saves on loading. Decode tok/s is against the bf16 `.ninfer` when it was run (the
    same file format, so the ratio is the recipe's alone), else the HF folder, also bf16.
    """
    base = rows[0]
    decode_base = next((r for r in rows if r["source"] == "bf16"), base)
    for row in rows:
        row["load_ratio"] = row["load_s"] / base["load_s"]
        row["rss_ratio"] = row["peak_rss"] / base["peak_rss"]
        if "decode_tok_s" in row and "decode_tok_s" in decode_base:
            row["decode_ratio"] = row["decode_tok_s"] / decode_base["decode_tok_s"]
            row["decode_baseline"] = decode_base["source"]


def render(result: dict) -> str:
    """The figures as a table: load and RSS × the HF folder, decode × the bf16 run."""
    head = (
        f"{'source':<10} {'file MiB':>9} {'weights MiB':>12} {'load s':>7} {'×':>5} "
        f"{'peak RSS MiB':>13} {'×':>5} {'decode tok/s':>13} {'×':>5} {'CPU share':>9}"
    )
    rows = result["rows"]
    lines = [
        f"model {result['model']}, {result['threads']} threads, "
        f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} new tokens, "
        f"best of {result['repeats']}",
        head,
    ]
    mib = 2**20
    for r in rows:
        decode = (
            f"{r['decode_tok_s']:>13.1f} {r['decode_ratio']:>5.2f} {r['cpu_share']:>9.2f}"
            if "decode_tok_s" in r
            else f"{'-':>13} {'-':>5} {'-':>9}"
        )
        lines.append(
            f"{r['source']:<10} {r['file_bytes'] / mib:>9.0f} {r['weight_bytes'] / mib:>12.0f} "
            f"{r['load_s']:>7.2f} {r['load_ratio']:>5.2f} {r['peak_rss'] / mib:>13.0f} "
            f"{r['rss_ratio']:>5.2f} {decode}"
        )
    baseline = next((r["decode_baseline"] for r in rows if "decode_baseline" in r), None)
    note = f"load and peak RSS × {rows[0]['source']}"
    lines.append(note + (f"; decode × {baseline}" if baseline else ""))
    for r in rows:  # each source's weight formats may take other kernels
        lines.append(f"{r['source']}: {kernel_ops_line(r.get('kernel_ops'))}")
    if any(r.get("cpu_share", 1.0) < 0.9 for r in rows):
        lines.append(
            "warning: a timed run got under 90% of its threads' CPU time; other processes "
            "were running and its figures are low. Rerun on a quiet machine."
        )
    return "\n".join(lines)
