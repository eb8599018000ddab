"""Per-recipe logit error on the Qwen3-0.6B-shaped benchmark checkpoint: the docs' table.

Every recipe's `.ninfer` (converted from, and cached beside, the checkpoint of
`ninfer_core.bench.checkpoint`) runs the same fixed prompts as the bf16 HF folder; per
prompt, the relative RMS of all its logits against the folder's and the share of
positions whose top-1 token agrees. The figures are the weights' quantization alone
when the compute is fp32 (the default), since both sides then run the same arithmetic.

    python bench/recipe_logits.py --prompts 4 --tokens 64 --threads 2
    python bench/recipe_logits.py build/builtin/hf --text build/builtin/heldout-code.txt

The second form measures a trained model (the built-in one's HF folder, as the training
script leaves it) on its own held-out text, where logits are far from flat and top-1
agreement means more than on random weights.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch


def logits_for(path: Path, prompts: list[list[int]], dtype: str) -> list[torch.Tensor]:
    """fp32 logits `[len(ids), vocab]` of every prompt, one prefill each."""
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.eval_ppl import sequence_logits
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    runtime = RuntimeConfig(dtype=dtype, max_context=max(map(len, prompts)) + 16)
    loaded = load_model(path, host=create_host(), device=probe_device(), runtime=runtime)
    out = [sequence_logits(loaded, ids) for ids in prompts]
    del loaded
    gc.collect()
    return out


def text_ids(model: Path, text: Path | None, n: int) -> list[int]:
    """The first `n` ids of `text` (default: the benchmark's prose) in the model's tokenizer."""
    from tokenizers import Tokenizer

    from ninfer_core.bench.checkpoint import prompt_ids

    if text is None:
        return prompt_ids(model, n)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tok.encode(text.read_text(), add_special_tokens=False).ids
    if len(ids) < n:
        raise SystemExit(f"{text} holds {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


def main() -> None:
    from ninfer_core.bench.agreement import logit_agreement
    from ninfer_core.bench.artifact import ensure_ninfer
    from ninfer_core.bench.checkpoint import ensure_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", type=Path, help="HF folder (default: the 0.6B checkpoint)")
    p.add_argument("--text", type=Path, help="prompt text file (default: English prose)")
    p.add_argument("--recipes", default="bf16,w8,q6,mixed,q4")
    p.add_argument("--prompts", type=int, default=4, help="fixed prompts (prose, in turn)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    source = args.model or ensure_checkpoint()
    ids = text_ids(source, args.text, args.prompts * args.tokens)
    prompts = [ids[i * args.tokens : (i + 1) * args.tokens] for i in range(args.prompts)]
    start = time.perf_counter()
    reference = logits_for(source, prompts, args.dtype)
    print(f"{source}: {args.prompts} prompts x {args.tokens} tokens, {args.dtype} compute, "
          f"{args.threads} threads; against the HF folder itself")  # fmt: skip
    print("| recipe | file MiB | rel. RMS of logits (mean / worst) | top-1 agree (mean / worst) |")
    print("| --- | --- | --- | --- |")
    for name in args.recipes.split(","):
        path = ensure_ninfer(source, name, 3)
        size = sum(f.stat().st_size for f in path.parent.glob(path.name + "*")) / 2**20
        got = logits_for(path, prompts, args.dtype)
        rows = [logit_agreement(g, r) for g, r in zip(got, reference, strict=True)]
        errs, agree = [r.rel_rms for r in rows], [r.top1 for r in rows]
        print(f"| {name} | {size:.1f} | {sum(errs) / len(errs):.4f} / {max(errs):.4f} | "
              f"{sum(agree) / len(agree):.3f} / {min(agree):.3f} |", flush=True)  # fmt: skip
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
