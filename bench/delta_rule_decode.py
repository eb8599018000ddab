"""A Gated DeltaNet decode step of B sequences: batched against one sequence at a time.

The reference ops (`ninfer_core.kernels.delta_rule`) advance every short sequence of a
step in one batched update. The baseline, timed in the same run, calls each op once per
sequence, which is the work the per-sequence loop did before: B recurrent updates and B
convolutions a layer. Shapes are one Qwen3-Next-80B linear-attention layer's (16 key
heads, 32 value heads of 128, conv kernel 4), fp32 states as the runtime keeps them.

    python bench/delta_rule_decode.py --threads 2 --batches 1,4,8 --dtype bf16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from ninfer_core.kernels.delta_rule import causal_conv1d, gated_delta_rule

HQK, HV, DK, DV, WIDTH = 16, 32, 128, 128, 4
CONV = 2 * HQK * DK + HV * DV
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def step_inputs(batch: int, tokens: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One step's activations and states for `batch` sequences of `tokens` tokens each."""
    gen = torch.Generator().manual_seed(batch)
    t = batch * tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "x": randn(t, CONV).to(dtype),
        "weight": (randn(CONV, WIDTH) * 0.5).to(dtype),
        "conv": randn(batch, CONV, WIDTH - 1),
        "q": randn(t, HQK, DK).to(dtype),
        "k": randn(t, HQK, DK).to(dtype),
        "v": randn(t, HV, DV).to(dtype),
        "g": -F.softplus(randn(t, HV)),
        "beta": randn(t, HV).sigmoid().to(dtype),
        "state": randn(batch, HV, DK, DV) * 0.1,
    }


def batched(x: dict[str, torch.Tensor], offsets: list[int]) -> None:
    """Both ops once over the whole step."""
    causal_conv1d(x["x"], x["weight"], None, x["conv"], offsets)
    gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], offsets)


def one_at_a_time(x: dict[str, torch.Tensor], offsets: list[int]) -> None:
    """Both ops once per sequence (the baseline)."""
    for b in range(len(offsets) - 1):
        rows, n = slice(offsets[b], offsets[b + 1]), offsets[b + 1] - offsets[b]
        causal_conv1d(x["x"][rows], x["weight"], None, x["conv"][b : b + 1], [0, n])
        args = (x[name][rows] for name in ("q", "k", "v", "g", "beta"))
        gated_delta_rule(*args, x["state"][b : b + 1], [0, n])


def best_ms(fn: Callable[[], None], repeats: int, rounds: int = 5) -> float:
    """The fastest of `rounds` means over `repeats` calls, in ms (after a warm-up)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,8", help="sequences in the step")
    p.add_argument("--tokens", type=int, default=1, help="tokens per sequence (decode: 1)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"one layer, {HV} value heads of {DK}x{DV}, conv {CONV}x{WIDTH}, {args.dtype}, "
          f"{args.tokens} token(s) a sequence, {args.threads} threads")  # fmt: skip
    print("| sequences | one at a time (ms) | batched (ms) | speedup |")
    print("| --- | --- | --- | --- |")
    with torch.inference_mode():
        for batch in (int(b) for b in args.batches.split(",")):
            x = step_inputs(batch, args.tokens, DTYPES[args.dtype])
            offsets = [b * args.tokens for b in range(batch + 1)]
            alone = best_ms(partial(one_at_a_time, x, offsets), args.repeats)
            together = best_ms(partial(batched, x, offsets), args.repeats)
            print(f"| {batch} | {alone:.3f} | {together:.3f} | {alone / together:.2f} |")


if __name__ == "__main__":
    main()
