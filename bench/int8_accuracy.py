"""What `--activation-dtype int8` costs in accuracy: prefill logits of int8 activations
(W8A8 / W4A8 over the model's quantized weights) against the float path.

Each fixed prompt is prefilled once per configuration; every configuration is compared
with the fp32 float path on the same quantized weights (the weights' own quantization
is therefore not in the figures): the relative RMS of all logits and the share of
positions whose top-1 token agrees. The float path in bf16 and fp16 stands beside it as
the baseline: the error that lower-precision activations already cost.

    python bench/int8_accuracy.py                       # the built-in trained model
    python bench/int8_accuracy.py MODEL.ninfer --tokens 256 --dtypes fp32,bf16

On the CPU the int8 path is the torch reference (`ninfer_core.kernels.int8_act`), an
emulation that computes the same numbers a GPU's integer kernel does (slower than the
float path here); prefill chunks of more than 16 rows take it, decode never does.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

#: Fixed prompts: prose, code and a tool call (the built-in model was trained on such).
PROMPTS = (
    "The river rose slowly through the night, and by morning the lower fields were under "
    "water. The farmers gathered at the bridge to decide whether to move the animals to the "
    "hill or to wait for the rain to stop. Nobody wanted to be the first to leave, but the "
    "old miller said that the water had never risen this fast in forty years.",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            "
    "out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n"
    "            j += 1\n    return out + a[i:] + b[j:]\n",
    '{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}} The '
    "weather in Berlin is cloudy with light rain, 12 degrees; tomorrow it clears up in the "
    "afternoon with a high of 16 degrees and wind from the west.",
)


def prompt_ids(model: Path, tokens: int) -> list[list[int]]:
    """Each prompt's first `tokens` ids in the model's tokenizer."""
    from ninfer_core.loading import open_artifact
    from ninfer_core.plugin_host import create_host
    from ninfer_core.text.tokenizer import Tokenizer

    tok = Tokenizer.from_artifact(open_artifact(create_host(), model))
    return [tok.encode(text, add_special_tokens=False)[:tokens] for text in PROMPTS]


def logits_for(model: Path, prompts: list[list[int]], dtype: str, activations: str):
    """fp32 logits `[len(ids), vocab]` of every prompt, one prefill each, and the linear
    op's backend."""
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.eval_ppl import sequence_logits
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    runtime = RuntimeConfig(
        dtype=dtype, activation_dtype=activations, max_context=max(map(len, prompts)) + 16
    )
    loaded = load_model(model, host=create_host(), device=probe_device(), runtime=runtime)
    linear = next(c for c in loaded.kernels if c.op == "linear").label
    out = [sequence_logits(loaded, ids) for ids in prompts]
    del loaded
    gc.collect()
    return out, linear


def main() -> None:
    from ninfer_core.bench.agreement import logit_agreement
    from ninfer_core.builtin_model import default_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", type=Path, help="a quantized model (default: built-in)")
    p.add_argument("--tokens", type=int, default=200, help="tokens per prompt (at most)")
    p.add_argument("--dtypes", default="fp32,bf16,fp16", help="compute dtypes to run")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    prompts = prompt_ids(model, args.tokens)
    start = time.perf_counter()
    reference, linear = logits_for(model, prompts, "fp32", "auto")
    lengths = "/".join(str(len(ids)) for ids in prompts)
    print(f"{model}: {len(prompts)} prompts of {lengths} tokens, {args.threads} threads; "
          f"every run against the fp32 float path (linear: {linear})")  # fmt: skip
    print("| compute | activations | linear | rel. RMS of logits (mean / worst) "
          "| top-1 agree (mean / worst) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for dtype in args.dtypes.split(","):
        for activations in ("auto", "int8"):
            if dtype == "fp32" and activations == "auto":
                continue  # the reference itself
            got, linear = logits_for(model, prompts, dtype, activations)
            rows = [logit_agreement(g, r) for g, r in zip(got, reference, strict=True)]
            errs, agree = [r.rel_rms for r in rows], [r.top1 for r in rows]
            shown = dtype if activations == "auto" else "int8 (prefill)"
            print(f"| {dtype} | {shown} | {linear} | {sum(errs) / len(errs):.4f} / "
                  f"{max(errs):.4f} | {sum(agree) / len(agree):.3f} / {min(agree):.3f} |",
                  flush=True)  # fmt: skip
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
