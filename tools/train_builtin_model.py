"""Train NInfer's built-in model on this machine's CPU, from a fixed seed.

    python tools/train_builtin_model.py --out build/builtin

A small Qwen3-architecture model (a byte-level BPE of VOCAB tokens, CONFIG below) with
a jointly trained multi-token-prediction head in the DeepSeek / Qwen3-Next form: one
extra decoder layer over `fc(concat(norm(embed(token[t+1])), norm(hidden[t])))` that
predicts token t+2 through the shared embedding and head. The corpus is built by
`builtin_corpus` from the standard library and synthetic agent transcripts.

Writes, under `--out`: `hf/` (the Hugging Face folder, MTP tensors named `mtp.*`),
`builtin-<recipe>.ninfer` for each evaluated recipe, `heldout-*.txt`, `loss.tsv` (the
loss curve) and `report.json` (held-out perplexity per recipe and source, MTP top-1).
`--install` copies the chosen recipe's file to where NInfer ships it.

The step count, not the clock, bounds training, so a rerun with the same seed on the
same Python reproduces the model; about 15-20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builtin_corpus import DOC_SEP, Corpus, build_corpus, write_heldout

from ninfer_core.builtin_model import BUILTIN_ARTIFACT, BUILTIN_NAME, SHAPE, TOKENIZER_CONFIG

SEED = 20261203
VOCAB = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: added as ordinary tokens so they stay in decoded text for the tool-call parser
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
#: the shipped decoder's shape (`SHAPE`) with the trained model's position settings
CONFIG = {**SHAPE, "rope_theta": 10000.0, "max_position_embeddings": 2048}
#: share of training windows drawn from each source
MIX = {"code": 0.5, "tools": 0.3, "docs": 0.2}
MTP_WEIGHT = 0.3
RECIPES = ("bf16", "w8", "q6", "mixed", "q4")


def train_tokenizer(train: Corpus, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(TAGS),
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(SEED)
    sample = rng.sample(train.code, min(len(train.code), 300)) + train.tools[:3000] + train.docs
    tok.train_from_iterator(sample, trainer=trainer)
    tok.add_tokens(TAGS)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    return tok


def encode_docs(tok, docs: list[str]) -> torch.Tensor:
    """All documents as one token stream, each followed by the separator."""
    sep = tok.token_to_id(DOC_SEP)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


class MTPHead(nn.Module):
    """One multi-token-prediction layer (the Qwen3-Next names, under `mtp.`)."""

    def __init__(self, config) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3RMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config, layer_idx=0)])
        self.norm = Qwen3RMSNorm(h, eps)

    def forward(self, next_embeds, hidden, position_embeddings) -> torch.Tensor:
        x = self.fc(
            torch.cat(
                [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1
            )
        )
        for layer in self.layers:
            out = layer(x, attention_mask=None, position_embeddings=position_embeddings)
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)


def build_model(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, attn_implementation="sdpa", bos_token_id=None, eos_token_id=2,
        pad_token_id=0, **CONFIG,
    )  # fmt: skip
    return Qwen3ForCausalLM(config), MTPHead(config)


def head_logits(model, mtp, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main-head logits for tokens 1.., MTP logits for tokens 2..) of windows `ids` [B, T]:
    the MTP layer at position t reads hidden[t] and the embedding of token t + 1."""
    body = model.model
    hidden = body(input_ids=ids).last_hidden_state
    next_embeds = body.embed_tokens(ids[:, 1:])
    rope = body.rotary_emb(next_embeds, torch.arange(ids.shape[1] - 1).unsqueeze(0))
    x = mtp(next_embeds, hidden[:, :-1], rope)
    return model.lm_head(hidden[:, :-1]), model.lm_head(x[:, :-1])


def losses(model, mtp, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP loss) for a batch of windows."""
    main, extra = head_logits(model, mtp, ids)
    return (
        F.cross_entropy(main.flatten(0, 1).float(), ids[:, 1:].flatten()),
        F.cross_entropy(extra.flatten(0, 1).float(), ids[:, 2:].flatten()),
    )


def windows(streams: dict[str, torch.Tensor], rng: torch.Generator, batch: int, seq: int):
    """`batch` random windows of `seq + 1` tokens, drawn per MIX."""
    names = list(MIX)
    weights = torch.tensor([MIX[n] for n in names])
    picks = torch.multinomial(weights, batch, replacement=True, generator=rng)
    rows = []
    for k in picks.tolist():
        stream = streams[names[k]]
        start = int(torch.randint(0, len(stream) - seq - 1, (1,), generator=rng))
        rows.append(stream[start : start + seq + 1])
    return torch.stack(rows)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def mtp_accuracy(model, mtp, stream: torch.Tensor, seq: int, limit: int) -> dict:
    """Top-1 of the MTP head (token t+2) and of the main head (t+1) on held-out text."""
    hit_mtp = hit_main = total = 0
    for start in range(0, min(len(stream), limit) - seq - 1, seq):
        ids = stream[start : start + seq + 1].unsqueeze(0)
        main, extra = head_logits(model, mtp, ids)
        main, pred = main[:, :-1].argmax(-1), extra.argmax(-1)  # both scored on tokens 2..
        hit_mtp += int((pred == ids[:, 2:]).sum())
        hit_main += int((main == ids[:, 1:-1]).sum())
        total += seq - 1
    return {"tokens": total, "mtp_top1": hit_mtp / total, "main_top1": hit_main / total}


def save_hf(model, mtp, out: Path) -> Path:
    from safetensors.torch import save_file

    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
    }
    tensors |= {f"mtp.{k}": v.detach().contiguous() for k, v in mtp.state_dict().items()}
    save_file(tensors, str(hf / "model.safetensors"))
    config = model.config.to_dict()
    config |= {"architectures": ["Qwen3ForCausalLM"], "num_nextn_predict_layers": 1}
    config["torch_dtype"] = "float32"
    config.pop("attn_implementation", None)
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(out / "tokenizer.json", hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    generation = {"eos_token_id": [2, 0], "temperature": 0.7, "top_p": 0.9, "do_sample": True}
    (hf / "generation_config.json").write_text(json.dumps(generation))
    return hf


def evaluate(hf: Path, heldout: dict[str, Path], out: Path, context: int, max_tokens: int) -> dict:
    """Convert to each recipe; its size and held-out perplexity (through NInfer itself)."""
    from ninfer_core.convert import convert

    result: dict[str, dict] = {}
    for name in RECIPES:
        path = out / f"builtin-{name}.ninfer"
        summary = convert(hf, path, recipe_name=name, model_id=BUILTIN_NAME)
        result[name] = {"bytes": path.stat().st_size, "bits_per_weight": summary.bits_per_weight}
        result[name] |= heldout_perplexity(path, heldout, context, max_tokens)
        print(name, result[name], flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/builtin"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--transcripts", type=int, default=4000)
    p.add_argument("--eval-tokens", type=int, default=40000, help="held-out tokens per source")
    p.add_argument("--install", default=None, metavar="RECIPE", help="ship this recipe's file")
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    ns.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    train, held = build_corpus(transcripts=ns.transcripts, heldout_transcripts=400, seed=SEED)
    tok = train_tokenizer(train, ns.out)
    streams = {name: encode_docs(tok, getattr(train, name)) for name in MIX}
    held_streams = {name: encode_docs(tok, getattr(held, name)) for name in ("code", "tools")}
    heldout = write_heldout(held, ns.out)
    sizes = {k: len(v) for k, v in streams.items()}
    print(f"corpus tokens {sizes}, held-out { ({k: len(v) for k, v in held_streams.items()}) }")

    model, mtp = build_model(SEED)
    params = [*model.parameters(), *mtp.parameters()]
    print(f"parameters: model {sum(p.numel() for p in model.parameters()):,}, "
          f"mtp {sum(p.numel() for p in mtp.parameters()):,}")  # fmt: skip
    opt = torch.optim.AdamW(params, lr=ns.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = torch.Generator().manual_seed(SEED)
    log = (ns.out / "loss.tsv").open("w")
    log.write("step\tseconds\tlr\tloss\tmtp_loss\n")
    model.train()
    mtp.train()
    for step in range(ns.steps):
        lr = lr_at(step, ns.steps, ns.lr, warmup=max(20, ns.steps // 10))
        for group in opt.param_groups:
            group["lr"] = lr
        ids = windows(streams, rng, ns.batch, ns.seq)
        main, extra = losses(model, mtp, ids)
        (main + MTP_WEIGHT * extra).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == ns.steps - 1:
            elapsed = time.perf_counter() - start
            log.write(f"{step}\t{elapsed:.1f}\t{lr:.2e}\t{main.item():.4f}\t{extra.item():.4f}\n")
            log.flush()
            print(f"step {step} {elapsed:.0f}s loss {main.item():.3f} mtp {extra.item():.3f}",
                  flush=True)  # fmt: skip
    train_seconds = time.perf_counter() - start
    model.eval()
    mtp.eval()
    hf = save_hf(model, mtp, ns.out)
    mtp_report = {
        name: mtp_accuracy(model, mtp, stream, ns.seq, ns.eval_tokens)
        for name, stream in held_streams.items()
    }
    print("mtp", mtp_report)

    recipes = evaluate(hf, heldout, ns.out, ns.seq, ns.eval_tokens)
    rand_model, rand_mtp = build_model(SEED + 1)
    rand_dir = ns.out / "random"
    rand_dir.mkdir(exist_ok=True)
    shutil.copy(ns.out / "tokenizer.json", rand_dir / "tokenizer.json")
    save_hf(rand_model, rand_mtp, rand_dir)
    random_ppl = heldout_perplexity(rand_dir / "hf", heldout, ns.seq, ns.eval_tokens)
    report = {
        "seed": SEED,
        "python": sys.version.split()[0],
        "steps": ns.steps,
        "batch": ns.batch,
        "seq": ns.seq,
        "train_seconds": round(train_seconds, 1),
        "corpus_tokens": sizes,
        "heldout_tokens": {k: len(v) for k, v in held_streams.items()},
        "parameters": sum(p.numel() for p in model.parameters()),
        "mtp_parameters": sum(p.numel() for p in mtp.parameters()),
        "mtp": mtp_report,
        "perplexity": recipes,
        "random_init_perplexity": random_ppl,
    }
    (ns.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if ns.install:
        BUILTIN_ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ns.out / f"builtin-{ns.install}.ninfer", BUILTIN_ARTIFACT)
        print(f"installed {ns.install} as {BUILTIN_ARTIFACT}")
    return 0


def heldout_perplexity(
    model: Path, heldout: dict[str, Path], context: int, max_tokens: int
) -> dict[str, float]:
    """Perplexity of `model` on each held-out file, through `ninfer eval-ppl`'s code."""
    from ninfer_core.eval_ppl import eval_ppl_file

    return {
        source: eval_ppl_file(model, file, context=context, max_tokens=max_tokens).perplexity
        for source, file in heldout.items()
    }


if __name__ == "__main__":
    raise SystemExit(main())
