"""What each role's width costs on a hybrid: logit error against the unquantized model.

A random-weight Qwen3.5-shaped hybrid (Gated DeltaNet 3 : 1 gated attention, dense MLPs,
untied head) is written once with transformers; then the same prompts run through it
unquantized (fp32 compute) and with its dense matrices quantized while loading
(`--recipe`, `ninfer_core/quant/at_load.py`) by each recipe below. Beside the shipped
recipes, ablations quantize one group of roles at a time (the rest at source), so the
Gated DeltaNet projections' share of the error can be read off. Per recipe: the relative
RMS of all logits against the unquantized run (mean over prompts) and the share of
positions whose top-1 token agrees.

    python bench/recipe_roles.py --prompts 4 --tokens 64 --threads 2

Random weights give flat logits, so top-1 agreement is a harsh measure here; the relative
RMS is the figure to compare between rows.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

#: Ablations: the roles quantized (everything else at source), each at the width `mixed`
#: gives it.
ABLATIONS = {
    "deltanet q|k|v|z only": ("linear_in",),
    "deltanet out only": ("linear_out",),
    "deltanet b|a only": ("linear_gates",),
    "mixed without deltanet": ("embed", "head", "qkv", "o", "gate_up", "down", "mtp_fc"),
}
SHIPPED = ("mixed", "q4", "w8")


def write_model(path: Path, seed: int) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=4096,
        tie_word_embeddings=False, max_position_embeddings=4096,
    )  # fmt: skip
    model = Qwen3_5ForCausalLM(config).eval()
    model.save_pretrained(path)


def register_ablations() -> None:
    """The ablations as recipes `--recipe` can name (this process only)."""
    from ninfer_core.quant.recipes import RECIPES, Recipe

    mixed = RECIPES["mixed"]
    for name, roles in ABLATIONS.items():
        kept = {role: mixed.roles[role] for role in roles}
        RECIPES[name] = Recipe(name, name, kept)


def logits(path: Path, prompts: list[list[int]], recipe: str) -> list[torch.Tensor]:
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.eval_ppl import sequence_logits
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host

    runtime = RuntimeConfig(dtype="fp32", recipe=recipe, max_context=4096)
    loaded = load_model(path, host=create_host(), device=probe_device(), runtime=runtime)
    return [sequence_logits(loaded, ids) for ids in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    register_ablations()
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, 4096, (args.tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_model(path, args.seed)
        base = logits(path, prompts, "none")
        print(f"{'recipe':<26} {'rel. RMS':>9} {'top-1 agrees':>13}")
        for name in (*SHIPPED, *ABLATIONS):
            rms, agree = [], []
            for got, want in zip(logits(path, prompts, name), base, strict=True):
                rms.append(float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()))
                agree.append(float((got.argmax(-1) == want.argmax(-1)).float().mean()))
            print(f"{name:<26} {sum(rms) / len(rms):>9.4f} {sum(agree) / len(agree):>12.1%}")


if __name__ == "__main__":
    main()
