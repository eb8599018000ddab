"""Decode over int8 and rk8v4 KV, eager against `--compile-decode`, in one run.

A model's cache is filled with `--context` tokens of random keys and values written
straight into the pages (as `ninfer bench kv` does: a 32K prefill would take minutes on a
CPU and measure prefill, not the cache); each decode step then reads the whole context
through the codec. Per codec and context three runtimes decode the same steps, in turn,
`--repeats` times: eager with the pages gathered and dequantized
(`NINFER_CPU_ATTENTION=0`: the eager path before the CPU kernel read codes), eager with
the kernel reading the codes in place, and the compiled step (its first step compiles:
an untimed warm-up). Each figure is the fastest repeat's median step.

    GOMP_SPINCOUNT=10000 python bench/compiled_kv_decode.py --threads 2 --contexts 1024,32768
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ninfer_core.bench.kv import _fill
from ninfer_core.config import RuntimeConfig
from ninfer_core.device import probe_device
from ninfer_core.engine.runtime import RuntimeSpec, build_runtime
from ninfer_core.engine.sequence import Sequence
from ninfer_core.loading import load_model
from ninfer_core.plugin_host import create_host
from ninfer_core.smollm2 import smollm2_path

#: (label, compiled, NINFER_CPU_ATTENTION) of the three ways a step runs.
WAYS = [("eager, gathered", False, "0"), ("eager, in place", False, "1"),
        ("compiled", True, "1")]  # fmt: skip


class Decoder:
    """One runtime over a filled cache: `steps` decode steps from `context`, timed."""

    def __init__(self, loaded, host, device, codec: str, context: int, steps: int, compiled: bool):
        spec = RuntimeSpec.for_tokens(context + steps + 8, 16, kv_dtype=codec,
                                      compile_decode=compiled)  # fmt: skip
        self.runtime = build_runtime(loaded, host, device, spec)
        self.context, self.steps = context, steps
        _fill(
            self.runtime.kv_store, loaded.config, context, loaded.dtype, self.runtime.runner.device
        )

    def run(self) -> list[float]:
        """Each step's seconds; the cache past `context` is rewritten every run."""
        runner, manager = self.runtime.runner, self.runtime.block_manager
        seq = Sequence([1] * (self.context + 1))
        manager.allocate(seq, self.context)  # blocks 0.. in order: slot = position
        seq.num_computed_tokens = self.context
        times = []
        for _ in range(self.steps):
            start = time.perf_counter()
            runner.run([(seq, 1)])
            times.append(time.perf_counter() - start)
            seq.append_token(1)
        manager.free(seq)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--codecs", default="int8,rk8v4")
    parser.add_argument("--contexts", default="1024,32768")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    host, device = create_host(), probe_device(use_cuda=False)
    path = args.model or smollm2_path()
    loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype=args.dtype))
    print(f"{path}, {args.dtype}, {torch.get_num_threads()} threads, {args.steps} steps")
    for codec in args.codecs.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            decoders = []
            for label, compiled, switch in WAYS:
                decoder = Decoder(loaded, host, device, codec, context, args.steps, compiled)
                os.environ["NINFER_CPU_ATTENTION"] = switch
                if compiled:
                    start = time.perf_counter()
                    decoder.run()  # compiles
                    print(f"  ({codec} {context}: compiled in {time.perf_counter() - start:.0f} s)")
                    assert decoder.runtime.runner.compiled.failed is None
                decoders.append((label, switch, decoder))
            best = {label: float("inf") for label, _, _ in decoders}
            for _ in range(args.repeats):
                for label, switch, decoder in decoders:
                    os.environ["NINFER_CPU_ATTENTION"] = switch
                    best[label] = min(best[label], statistics.median(decoder.run()))
            base = best[WAYS[0][0]]
            cells = ", ".join(
                f"{label} {1e3 * s:.2f} ms ({1 / s:.1f} tok/s, {base / s:.2f}x)"
                for label, s in best.items()
            )
            print(f"{codec} {context}: {cells}", flush=True)
            del decoders


if __name__ == "__main__":
    main()
