"""`ninfer bench decode`: NInfer's prefill and decode tok/s against a peer engine, same run.

The peer (`--peer`) is llama.cpp through `llama-cpp-python` for a GGUF file when that is
installed (an optional peer, never a dependency: `peers.LLAMA_CPP_INSTALL`), transformers
`generate` for a Hugging Face folder (or a GGUF, dequantized), or none. Both engines run
the same prompt ids (English prose, the model's own tokenizer) greedily for the same
number of tokens on the same threads, one engine at a time (the other freed), after one
warm-up generation each. Decode tok/s counts the tokens after the first over the time
from the first token's logits to the last's, so prefill is excluded on both sides the
same way. NInfer runs the request through its engine, exactly as `ninfer generate` does.
The ceiling (bandwidth ÷ bytes read per token) says how far either is from the hardware;
the step breakdown (`step_profile`) says where NInfer's decode step spends its time.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ninfer_core.config import opt
from ninfer_core.errors import NInferError

if TYPE_CHECKING:
    from ninfer_core.bench.step_profile import StepBreakdown

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WARMUP_TOKENS = 4


@dataclass
class TimedRunConfig:
    """Timed greedy generation: the options every generation benchmark shares."""

    new: int = opt(64, "tokens generated per timed run (greedy, eos ignored)")
    prompt_tokens: int = opt(512, "prompt length in tokens (English prose)")
    threads: int = opt(0, "threads of each engine (torch, llama.cpp); 0: one per available core")
    repeats: int = opt(1, "timed runs per configuration; each figure is the best of them")
    out: str | None = opt(None, "where the random checkpoint (and files made from it) is cached")
    as_json: bool = opt(False, "print the figures as JSON", flag="--json")

    def thread_count(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))

    def check(self) -> None:
        """Raise ValueError for counts no run can use (decode speed needs two tokens)."""
        if self.new < 2 or self.prompt_tokens < 1 or self.repeats < 1:
            raise ValueError("--new must be at least 2, --prompt-tokens and --repeats at least 1")


@dataclass
class DecodeBenchConfig(TimedRunConfig):
    """Decode benchmark: NInfer against llama.cpp or transformers on one model."""

    dtypes: str = opt("bf16,fp32", "comma-separated compute dtypes to run (bf16, fp32)")
    peer: Literal["auto", "transformers", "llama.cpp", "none"] = opt(
        "auto",
        "the engine to compare against; auto: llama.cpp for a .gguf when llama-cpp-python is "
        "installed, else transformers where it loads the model, else none",
    )
    breakdown: bool = opt(
        True, "after the timed runs, profile NInfer's decode step (ms per step by part)"
    )
    compile_decode: bool = opt(
        False, "NInfer decodes through its compiled step (compiled in the warm-up run)"
    )
    activation_dtype: Literal["auto", "int8"] = opt(
        "auto",
        "NInfer's prefill linears over quantized weights: int8 activations (W8A8/W4A8; "
        "a quantized model only); auto: the compute dtype",
    )

    def dtype_list(self) -> list[str]:
        names = [d.strip() for d in self.dtypes.split(",") if d.strip()]
        unknown = [d for d in names if d not in DTYPES]
        if unknown or not names:
            raise ValueError(f"--dtypes: unknown {unknown or names}; known: {', '.join(DTYPES)}")
        return names


@dataclass
class EngineRun:
    """One timed generation: speeds, and the greedy ids for the agreement check."""

    prefill_tok_s: float
    decode_tok_s: float
    token_ids: list[int] = field(repr=False)
    #: CPU seconds the process got ÷ (wall seconds × threads): well under 1 means other
    #: processes took cores from it and the figures are low (2 cores are easily shared).
    cpu_share: float = 1.0
    #: NInfer's runs: which backend served each op (`OpChoice.to_json`, from the load).
    kernel_ops: list[dict] = field(default_factory=list)
    #: NInfer's runs with `breakdown=True`: where a decode step's time went.
    breakdown: StepBreakdown | None = None
    #: NInfer's runs with `compile_decode=True`: whether the compiled decode step ran.
    compiled: str | None = None


class CpuShare:
    """Measures `EngineRun.cpu_share` over a `with` block."""

    def __enter__(self) -> CpuShare:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.wall
        self.share = (time.process_time() - self.cpu) / (wall * torch.get_num_threads())


def best_of(runs: list[EngineRun]) -> EngineRun:
    """The least disturbed figures of repeated runs: the fastest decode, the fastest prefill."""
    best = max(runs, key=lambda r: r.decode_tok_s)
    return replace(best, prefill_tok_s=max(r.prefill_tok_s for r in runs))


def run_ninfer(
    path: Path,
    dtype: str,
    prompt: list[int],
    new: int,
    repeats: int,
    *,
    breakdown: bool = False,
    compile_decode: bool = False,
    activation_dtype: str = "auto",
) -> EngineRun:
    """NInfer's figures: the request through the engine as `ninfer generate` runs it. With
    `breakdown`, one more request after the timed runs, on the same engine, is profiled
    (`step_profile.profile_decode`) into `EngineRun.breakdown`. With `compile_decode`, the
    warm-up generation compiles the decode step (`engine/compiled_step.py`), and
    `EngineRun.compiled` says whether the timed runs used it. `activation_dtype` is
    `--activation-dtype` (int8: prefill linears over quantized weights in W8A8/W4A8)."""
    from ninfer_core.bench.greedy import greedy_stats
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.generation import one_request_engine
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    host, device = create_host(), probe_device()
    runtime = RuntimeConfig(dtype=dtype, max_context=max(4096, len(prompt) + new + 1),
                            compile_decode=compile_decode,
                            activation_dtype=activation_dtype)  # fmt: skip
    loaded = load_model(path, host=host, device=device, runtime=runtime)
    engine = one_request_engine(loaded, host=host, device=device, runtime=runtime)
    kernel_ops = [c.to_json() for c in loaded.kernels]

    try:
        greedy_stats(engine, prompt, WARMUP_TOKENS)
        runs = []
        for _ in range(repeats):
            with CpuShare() as cpu:
                stats = greedy_stats(engine, prompt, new)
            runs.append(EngineRun(stats.prefill_tok_s, stats.decode_tok_s,
                                  list(stats.token_ids), cpu.share, kernel_ops))  # fmt: skip
        best = best_of(runs)
        if compile_decode:
            best = replace(best, compiled=compiled_note(engine.runner))
        if breakdown:
            from ninfer_core.bench.step_profile import profile_decode

            best = replace(best, breakdown=profile_decode(engine, prompt, new))
    finally:
        engine.close()
    return best


def compiled_note(runner) -> str:
    """What became of `--compile-decode` on `runner`: used, failed or refused, and why."""
    from ninfer_core.engine.compiled_step import capture_refusal

    compiled = runner.compiled
    if compiled is None:
        return f"not used: {capture_refusal(runner.model, runner.kv_store)}"
    if compiled.failed is not None:
        return f"failed, decoded eagerly: {compiled.failed}"
    return f"used ({compiled.steps} steps)"


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading greedy ids two runs share (random weights: near-ties diverge)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def model_config(path: Path) -> dict[str, Any]:
    """The model's `config.json`, from whatever artifact `path` is (folder, .ninfer, GGUF)."""
    from ninfer_core.loading import opened_artifact

    with opened_artifact(path) as artifact:
        return dict(artifact.config)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_bench(cfg: DecodeBenchConfig, model: str | None = None) -> dict:
    """Every figure of the benchmark, as plain data (the CLI prints or dumps it)."""
    from ninfer_core.bench.bandwidth import (
        DecodeBytes,
        artifact_weight_bytes,
        decode_bytes,
        measure_read_gbs,
    )
    from ninfer_core.bench.checkpoint import ensure_checkpoint, prompt_ids
    from ninfer_core.bench.peers import (
        choose_peer,
        gguf_weight_bytes,
        is_gguf,
        peer_version,
        run_llama_cpp,
        run_transformers,
    )

    dtypes, threads = cfg.dtype_list(), cfg.thread_count()
    path = Path(model) if model else ensure_checkpoint(Path(cfg.out) if cfg.out else None)
    if not path.exists():
        raise NInferError(f"{path}: no such file or folder")
    peer, peer_note = choose_peer(cfg.peer, path)  # before anything is measured
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    config = model_config(path)
    prompt = prompt_ids(path, cfg.prompt_tokens)
    if len(prompt) < cfg.prompt_tokens:
        raise NInferError(f"the tokenizer gave {len(prompt)} ids, fewer than --prompt-tokens")
    file_bytes = gguf_weight_bytes(path) if is_gguf(path) else None
    weight_source = "every matrix at the compute dtype"
    if file_bytes is not None:
        weight_source = "the GGUF's tensors as stored"
    gbs = measure_read_gbs()
    rows = []
    once: EngineRun | None = None  # llama.cpp runs the file as it is: once for every dtype
    for dtype in dtypes:
        size = DTYPES[dtype].itemsize
        # Decode step k attends over prompt + k tokens (k = 1 .. new-1): new/2 on average.
        need = decode_bytes(config, size, size, cfg.prompt_tokens + cfg.new / 2)
        if file_bytes is not None:
            need = DecodeBytes(weights=file_bytes, kv=need.kv)
        elif held := artifact_weight_bytes(path, DTYPES[dtype]):
            need = DecodeBytes(weights=held, kv=need.kv)
            weight_source = "the .ninfer's matrices as the torch backend holds them"
        ours = run_ninfer(path, dtype, prompt, cfg.new, cfg.repeats, breakdown=cfg.breakdown,
                          compile_decode=cfg.compile_decode,
                          activation_dtype=cfg.activation_dtype)  # fmt: skip
        gc.collect()  # one engine at a time: NInfer's is gone before the peer loads
        ref: EngineRun | None = None
        if peer == "transformers":
            ref = run_transformers(path, dtype, prompt, cfg.new, cfg.repeats)
            gc.collect()
        elif peer == "llama.cpp":
            if once is None:
                once = run_llama_cpp(path, prompt, cfg.new, cfg.repeats, threads)
                gc.collect()
            ref = once
        ceiling = need.ceiling_tok_s(gbs)
        rows.append({
            "dtype": dtype,
            "ninfer_decode_tok_s": ours.decode_tok_s,
            "peer_decode_tok_s": ref.decode_tok_s if ref else None,
            "ratio": _ratio(ours.decode_tok_s, ref.decode_tok_s if ref else None),
            "ceiling_tok_s": ceiling,
            "ninfer_pct_of_ceiling": 100 * ours.decode_tok_s / ceiling,
            "peer_pct_of_ceiling": 100 * ref.decode_tok_s / ceiling if ref else None,
            "ninfer_prefill_tok_s": ours.prefill_tok_s,
            "peer_prefill_tok_s": ref.prefill_tok_s if ref else None,
            "prefill_ratio": _ratio(ours.prefill_tok_s, ref.prefill_tok_s if ref else None),
            "weight_bytes_per_token": need.weights,
            "kv_bytes_per_token": need.kv,
            "greedy_ids_agree": agreeing_prefix(ours.token_ids, ref.token_ids) if ref else None,
            "ninfer_cpu_share": ours.cpu_share,
            "peer_cpu_share": ref.cpu_share if ref else None,
            "new_tokens": cfg.new,
            "kernel_ops": ours.kernel_ops,
            "breakdown": ours.breakdown.to_json() if ours.breakdown else None,
            "compiled_decode": ours.compiled,
        })  # fmt: skip
    return {
        "model": str(path),
        "peer": peer,
        "peer_version": peer_version(peer),
        "peer_note": peer_note,
        "weight_bytes": weight_source,
        "threads": threads,
        "prompt_tokens": cfg.prompt_tokens,
        "new_tokens": cfg.new,
        "repeats": cfg.repeats,
        "read_gb_s": gbs,
        "load_average": [load_before, os.getloadavg()],
        "torch": torch.__version__,
        "rows": rows,
    }


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(result: Mapping[str, Any]) -> str:
    """The figures as a Markdown table (what bench/README.md keeps)."""
    peer = result.get("peer") or "peer"
    header = ("dtype", "ninfer tok/s", f"{peer} tok/s", "ratio", "ceiling tok/s",
              f"% of ceiling (ninfer / {peer})", f"prefill tok/s (ninfer / {peer})",
              "prefill ratio", "greedy ids agree", f"CPU share (ninfer / {peer})")  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in result["rows"]:
        agree = r.get("greedy_ids_agree")
        cells = (
            r["dtype"],
            f"{r['ninfer_decode_tok_s']:.1f}",
            _cell(r.get("peer_decode_tok_s"), ".1f"),
            _cell(r.get("ratio"), ".2f"),
            f"{r['ceiling_tok_s']:.1f}",
            f"{r['ninfer_pct_of_ceiling']:.0f}% / {_cell(r.get('peer_pct_of_ceiling'), '.0f')}%",
            f"{r['ninfer_prefill_tok_s']:.0f} / {_cell(r.get('peer_prefill_tok_s'), '.0f')}",
            _cell(r.get("prefill_ratio"), ".2f"),
            "-" if agree is None else f"{agree} of {r['new_tokens']}",
            f"{r['ninfer_cpu_share']:.2f} / {_cell(r.get('peer_cpu_share'), '.2f')}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def breakdown_text(data: Mapping[str, Any]) -> str:
    """`StepBreakdown.render()` of a breakdown kept as its `to_json()`."""
    from ninfer_core.bench.step_profile import StepBreakdown

    return StepBreakdown(data["steps"], data["step_ms"], dict(data["parts_ms"]),
                         dict(data["linear_ms_by_weight"]),
                         dict(data["calls_per_step"])).render()  # fmt: skip


def low_cpu_shares(result: Mapping[str, Any], floor: float = 0.9) -> list[str]:
    """`engine (dtype) share` for every timed run that got under `floor` of its threads."""
    low = []
    for r in result["rows"]:
        for engine, key in (("ninfer", "ninfer_cpu_share"), (result.get("peer"), "peer_cpu_share")):
            share = r.get(key)
            if share is not None and share < floor:
                low.append(f"{engine} ({r['dtype']}) {share:.2f}")
    return low


def render(result: Mapping[str, Any]) -> str:
    """The header, the table, NInfer's step breakdown and any CPU-share warning."""
    from ninfer_core.bench import kernel_ops_line

    peer, version = result.get("peer"), result.get("peer_version")
    named = f"{peer} {version}" if peer and version else peer
    lines = [f"model: {result['model']}", f"peer: {named or 'none'} ({result.get('peer_note')})"]
    load = result.get("load_average")
    load_text = (f", load average (1 min) {load[0][0]:.2f} before, {load[1][0]:.2f} after "
                 f"(on {os.cpu_count()} CPUs)") if load else ""  # fmt: skip
    lines.append(
        f"threads: {result['threads']} for each engine, prompt {result['prompt_tokens']} "
        f"tokens, {result['new_tokens']} new, best of {result['repeats']}, read bandwidth "
        f"{result['read_gb_s']:.1f} GB/s{load_text}"
    )
    source = result.get("weight_bytes")
    for r in result["rows"]:
        lines.append(
            f"{r['dtype']}: {r['weight_bytes_per_token'] / 1e9:.3f} GB weights"
            f"{f' ({source})' if source else ''} + {r['kv_bytes_per_token'] / 1e6:.1f} MB KV "
            f"read per token; {kernel_ops_line(r['kernel_ops'])}"
            + (
                f"; compiled decode step: {r['compiled_decode']}"
                if r.get("compiled_decode")
                else ""
            )
        )
    lines += ["", table(result)]
    for r in result["rows"]:
        if r.get("breakdown"):
            lines += ["", f"NInfer's decode step, {r['dtype']}:", breakdown_text(r["breakdown"])]
    low = low_cpu_shares(result)
    if low:
        lines += [
            "",
            f"warning: timed runs got under 90% of their threads' CPU time ({', '.join(low)}); "
            "other processes were running and those figures are low. Rerun on a quiet machine.",
        ]
    return "\n".join(lines)
