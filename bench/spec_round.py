"""Where one speculative round's time goes, eager against compiled, in the same run.

A round is the engine's step (the verifying forward over each sequence's pending token
and its k drafts) plus the drafter's `propose` (for `mtp`: the catch-up forward of the
MTP layer, k - 1 single-token draft steps, an argmax after each). This times each part
in the running engine (wall-clock around the methods, so the parts add up to the step),
for engines that differ only in what is compiled, generating the same greedy tokens
from the same prompts, alternated (A, B, A, B); each figure is the fastest run's mean
per round. The baseline (no speculation, compiled decode step when compiling) is timed
beside them: its ms a token is the "plain step" a round competes with.

    GOMP_SPINCOUNT=10000 python bench/spec_round.py --threads 2 --class json --k 3
    python bench/spec_round.py --model smollm2-mtp.ninfer --lm-head-draft --configs verify+draft

Configurations (`--configs`): `eager` (nothing compiled), `verify` (`--compile-decode`:
decode step and verifying forward compiled), `verify+draft` (also the MTP drafter's
catch-up and draft steps, one graph: `ninfer_plugins/draft_mtp/compiled.py`).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch

PARTS = (
    "forward",
    "verify graph",
    "propose",
    "catch-up",
    "draft steps",
    "argmax",
    "compiled drafting",
    "drafting graph",
)


class Clock:
    """Seconds spent in each wrapped method, and rounds (engine steps) counted."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.step_seconds = 0.0
        #: The next step is a request's first (its prefill): not counted.
        self.skip_next = False

    def wrap(self, owner: object, name: str, part: str) -> None:
        fn: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)


def build(loaded, host, device, dtype: str, compile_decode: bool, k: int, draft: bool, head: bool):
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.generation import one_request_engine
    from ninfer_core.spec.config import SpecConfig

    runtime = RuntimeConfig(dtype=dtype, max_context=1024, compile_decode=compile_decode)
    spec = SpecConfig(spec="mtp", draft_tokens=k, lm_head_draft=head) if k else None
    engine = one_request_engine(loaded, host=host, device=device, runtime=runtime, spec=spec)
    if k and not draft and getattr(engine.drafter, "compiled", None) is not None:
        engine.drafter.compiled = None  # the draft steps eager
    clock = Clock()
    if k:
        clock.wrap(engine.runner, "step", "forward")
        clock.wrap(engine.drafter, "propose", "propose")
        clock.wrap(engine.drafter, "_catch_up", "catch-up")
        clock.wrap(engine.drafter, "_draft", "draft steps")
        clock.wrap(engine.drafter, "_propose_compiled", "compiled drafting")
        if engine.runner.verify is not None:
            clock.wrap(engine.runner.verify, "_fn", "verify graph")
        if engine.drafter.compiled is not None:
            clock.wrap(engine.drafter.compiled, "_fn", "drafting graph")
        if engine.drafter.compiled is None:  # the compiled graph calls it: not wrapped
            clock.wrap(engine.drafter.head, "argmax", "argmax")
    step = engine.step

    def counted():
        before, start = dict(clock.seconds), time.perf_counter()
        try:
            return step()
        finally:
            if clock.skip_next:  # a prefill: its parts are taken back out
                clock.skip_next = False
                clock.seconds.clear()
                clock.seconds.update(before)
            else:
                clock.step_seconds += time.perf_counter() - start
                clock.steps += 1

    engine.step = counted
    return engine, clock


def main() -> None:
    from ninfer_core.bench.greedy import greedy_stats
    from ninfer_core.bench.spec_prompts import class_prompts
    from ninfer_core.builtin_model import default_model
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.generation import PromptText
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host
    from ninfer_core.text import Tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--class", dest="cls", default="json")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--configs", default="eager,verify,verify+draft")
    p.add_argument("--model", help="an artifact with an MTP layer (default: the built-in model)")
    p.add_argument("--lm-head-draft", action="store_true", help="draft through its reduced head")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(args.model or default_model(), host=host, device=device,
                        runtime=RuntimeConfig(dtype=args.dtype))  # fmt: skip
    text = PromptText.from_loaded(loaded, Tokenizer.from_artifact(loaded.artifact))
    prompts = class_prompts(args.cls, text, builtin=args.model is None)
    names = args.configs.split(",")
    engines = {}
    for name in names:
        compiled = name != "eager"
        engines[name] = build(loaded, host, device, args.dtype, compiled, args.k, "draft" in name,
                              args.lm_head_draft)  # fmt: skip
        engines[f"{name} baseline"] = build(loaded, host, device, args.dtype, compiled, 0, False,
                                            False)  # fmt: skip
    best: dict[str, tuple[float, dict, int]] = {}
    for run in range(args.runs + 1):  # run 0 compiles and warms
        order = list(engines) if run % 2 else list(engines)[::-1]
        for name in order:
            engine, clock = engines[name]
            clock.seconds.clear()
            clock.steps, clock.step_seconds = 0, 0.0
            for _, prompt in prompts:
                clock.skip_next = True
                greedy_stats(engine, prompt, args.new)
            if run == 0:
                continue
            per = clock.step_seconds / clock.steps
            if name not in best or per < best[name][0]:
                best[name] = (per, dict(clock.seconds), clock.steps)
    print(f"class {args.cls}, mtp k={args.k}, {args.dtype}, {args.threads} threads, "
          f"{len(prompts)} prompts x {args.new} tokens, best of {args.runs} "
          "(ms per engine step)")  # fmt: skip
    print("| config | step | " + " | ".join(PARTS) + " | rest | steps |")
    print("|" + " --- |" * (len(PARTS) + 4))
    for name, (engine, _) in engines.items():
        verify, drafter = engine.runner.verify, getattr(engine.drafter, "compiled", None)
        drafted = "-" if drafter is None else f"{drafter.steps} (failed: {drafter.failed})"
        print(f"{name}: compiled rounds {verify.steps if verify else '-'}, compiled drafting "
              f"{drafted}")  # fmt: skip
    for name, (per, seconds, steps) in best.items():
        parts = [seconds.get(part, 0.0) / steps * 1e3 for part in PARTS]
        covered = parts[PARTS.index("forward")] + parts[PARTS.index("propose")]
        rest = per * 1e3 - covered if seconds else per * 1e3
        cells = " | ".join(f"{x:.3f}" for x in parts)
        print(f"| {name} | {per * 1e3:.3f} | {cells} | {rest:.3f} | {steps} |")


if __name__ == "__main__":
    main()
