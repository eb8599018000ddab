"""`ninfer bench decode`: ninfer's decode tok/s against transformers `generate`, same run.

Both engines load the same folder, run the same prompt ids greedily for the same number of
tokens on the same threads, one engine at a time (the other freed), after one warm-up
generation each. Decode tok/s counts the tokens after the first over the time from the
first token's logits to the last's, so prefill is excluded on both sides the same way.
NInfer runs the request through its engine, exactly as `ninfer generate` does.
The ceiling (bandwidth ÷ bytes read per token) says how far either is from the hardware.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ninfer_core.config import opt

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WARMUP_TOKENS = 4


@dataclass
class TimedRunConfig:
    """Timed greedy generation: the options every generation benchmark shares."""

    new: int = opt(64, "tokens generated per timed run (greedy, eos ignored)")
    prompt_tokens: int = opt(512, "prompt length in tokens (English prose)")
    threads: int = opt(0, "torch threads; 0: one per available core")
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
    """Decode benchmark: ninfer against transformers on one checkpoint."""

    dtypes: str = opt("bf16,fp32", "comma-separated compute dtypes to run (bf16, fp32)")

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


def run_ninfer(path: Path, dtype: str, prompt: list[int], new: int, repeats: int) -> EngineRun:
    """NInfer's figures: the request through the engine as `ninfer generate` runs it."""
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.engine.request import GenerationRequest
    from ninfer_core.generation import GenerationStats, one_request_engine, stream
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host
    from ninfer_core.sampling import SamplingParams

    host, device = create_host(), probe_device()
    runtime = RuntimeConfig(dtype=dtype, max_context=max(4096, len(prompt) + new + 1))
    loaded = load_model(path, host=host, device=device, runtime=runtime)
    engine = one_request_engine(loaded, host=host, device=device, runtime=runtime)
    kernel_ops = [c.to_json() for c in loaded.kernels]

    def generate(n: int) -> GenerationStats:
        stats = GenerationStats()
        request = GenerationRequest(prompt, SamplingParams(temperature=0.0), max_tokens=n,
                                    ignore_eos=True)  # fmt: skip
        for _ in stream(engine, request, stats):
            pass
        return stats

    generate(WARMUP_TOKENS)
    runs = []
    for _ in range(repeats):
        with CpuShare() as cpu:
            stats = generate(new)
        runs.append(EngineRun(stats.prefill_tok_s, stats.decode_tok_s, list(stats.token_ids),
                              cpu.share, kernel_ops))  # fmt: skip
    engine.close()
    return best_of(runs)


def run_transformers(
    path: Path, dtype: str, prompt: list[int], new: int, repeats: int
) -> EngineRun:
    from ninfer_core.extras import require

    require("transformers", "bench", needed_by="ninfer bench decode's transformers baseline")
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the loading bar would interleave with the table

    class Clock(LogitsProcessor):
        """Called once per new token, right after its forward: the token timestamps."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype]).eval()
    ids = torch.tensor([prompt])
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def generate(n: int) -> EngineRun:
        clock = Clock()
        start = time.perf_counter()
        with CpuShare() as cpu:
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([clock]),
            )
        first, last = clock.times[0], clock.times[-1]
        decode = (len(clock.times) - 1) / (last - first) if last > first else 0.0
        new_ids = out[0, len(prompt) :].tolist()
        return EngineRun(len(prompt) / (first - start), decode, new_ids, cpu.share)

    with torch.inference_mode():
        generate(WARMUP_TOKENS)
        return best_of([generate(new) for _ in range(repeats)])


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading greedy ids two runs share (random weights: near-ties diverge)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_bench(cfg: DecodeBenchConfig, model: str | None = None) -> dict:
    """Every figure of the benchmark, as plain data (the CLI prints or dumps it)."""
    import json

    from ninfer_core.bench.bandwidth import decode_bytes, measure_read_gbs
    from ninfer_core.bench.checkpoint import ensure_checkpoint, prompt_ids

    dtypes, threads = cfg.dtype_list(), cfg.thread_count()
    torch.set_num_threads(threads)
    path = Path(model) if model else ensure_checkpoint(Path(cfg.out) if cfg.out else None)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    prompt = prompt_ids(path, cfg.prompt_tokens)
    if len(prompt) < cfg.prompt_tokens:
        raise ValueError(f"the tokenizer gave {len(prompt)} ids, fewer than --prompt-tokens")
    gbs = measure_read_gbs()
    rows = []
    for dtype in dtypes:
        size = DTYPES[dtype].itemsize
        # Decode step k attends over prompt + k tokens (k = 1 .. new-1): new/2 on average.
        need = decode_bytes(config, size, size, cfg.prompt_tokens + cfg.new / 2)
        ours = run_ninfer(path, dtype, prompt, cfg.new, cfg.repeats)
        gc.collect()
        ref = run_transformers(path, dtype, prompt, cfg.new, cfg.repeats)
        gc.collect()
        ceiling = need.ceiling_tok_s(gbs)
        rows.append({
            "dtype": dtype,
            "ninfer_decode_tok_s": ours.decode_tok_s,
            "transformers_decode_tok_s": ref.decode_tok_s,
            "ratio": ours.decode_tok_s / ref.decode_tok_s if ref.decode_tok_s else None,
            "ceiling_tok_s": ceiling,
            "ninfer_pct_of_ceiling": 100 * ours.decode_tok_s / ceiling,
            "transformers_pct_of_ceiling": 100 * ref.decode_tok_s / ceiling,
            "ninfer_prefill_tok_s": ours.prefill_tok_s,
            "transformers_prefill_tok_s": ref.prefill_tok_s,
            "weight_bytes_per_token": need.weights,
            "kv_bytes_per_token": need.kv,
            "greedy_ids_agree": agreeing_prefix(ours.token_ids, ref.token_ids),
            "ninfer_cpu_share": ours.cpu_share,
            "transformers_cpu_share": ref.cpu_share,
            "new_tokens": cfg.new,
            "kernel_ops": ours.kernel_ops,
        })  # fmt: skip
    return {
        "model": str(path),
        "threads": threads,
        "prompt_tokens": cfg.prompt_tokens,
        "new_tokens": cfg.new,
        "repeats": cfg.repeats,
        "read_gb_s": gbs,
        "torch": torch.__version__,
        "rows": rows,
    }
