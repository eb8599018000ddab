"""The hybrid's decode step eager against `--compile-decode`, in one run.

`ninfer bench context`'s Qwen3-Next-shaped hybrid (random weights, built on first use:
3 Gated DeltaNet layers to 1 gated full-attention layer, dense MLPs) prefills a prompt of
`--context` tokens and decodes `--new` more, one token a step through the engine's runner,
once eagerly and once through the compiled step; the two alternate `--repeats` times and
each figure is the fastest run's median step. The first compiled run compiles (untimed
warm-up). Greedy ids of the two are compared.

    GOMP_SPINCOUNT=10000 python bench/compiled_hybrid_decode.py --threads 2 --context 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ninfer_core.bench.context_models import ensure_models
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.sequence import Sequence
from ninfer_core.generation import one_request_engine
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host


def runner_for(path, dtype: str, context: int, compile_decode: bool):
    host, device = create_host(), probe_device(use_cuda=False)
    runtime = RuntimeConfig(dtype=dtype, max_context=context + 256, compile_decode=compile_decode)
    loaded = load_model(path, host=host, device=device, runtime=runtime)
    return one_request_engine(loaded, host=host, device=device, runtime=runtime).runner


def decode(runner, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """Greedy ids and each decode step's seconds."""
    seq = Sequence(list(prompt))
    seq.state_slot = runner.states.allocate()
    logits = runner.run([(seq, len(prompt))])
    times = []
    for _ in range(new):
        seq.append_token(int(logits[0].argmax()))
        start = time.perf_counter()
        logits = runner.run([(seq, 1)])
        times.append(time.perf_counter() - start)
    runner.block_manager.free(seq)
    runner.states.free(seq.state_slot)
    return seq.completion_ids, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "medium"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = ensure_models(args.size)["hybrid"]
    prompt = [(7 * i + 3) % 250 + 3 for i in range(args.context)]
    runners = {name: runner_for(path, args.dtype, args.context, name == "compiled")
               for name in ("eager", "compiled")}  # fmt: skip
    start = time.perf_counter()
    decode(runners["compiled"], prompt, 4)  # compiles
    print(f"compiled in {time.perf_counter() - start:.1f} s")
    best: dict[str, float] = {}
    ids: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            ids[name], times = decode(runner, prompt, args.new)
            best[name] = min(best.get(name, float("inf")), statistics.median(times))
    assert runners["compiled"].compiled.failed is None, runners["compiled"].compiled.failed
    for name in runners:
        print(f"{name:9s} {best[name] * 1e3:6.2f} ms a step  {1 / best[name]:7.1f} tok/s")
    agree = sum(a == b for a, b in zip(ids["eager"], ids["compiled"], strict=True))
    ratio = best["eager"] / best["compiled"]
    print(f"compiled / eager: {ratio:.2f}x; greedy ids agree on {agree} of {args.new}")


if __name__ == "__main__":
    main()
